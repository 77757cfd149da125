#!/usr/bin/env bash
# Every GPU check of timeshare in one run, for the first machine with a CUDA device:
#
#     scripts/gpu_check.sh [OUT.json]        (default runs/gpu_check.json; PYTHON=.venv/bin/python)
#
# 1. every test marked `gpu` (CUDA IPC staging, the channel with CUDA tensors, FSDP and Megatron
#    on CUDA), as JUnit XML;
# 2. the channel device to device against the device's own copy (benchmarks/gpu_channel.py);
# 3. into vLLM (benchmarks/vllm_sync.py) and the FSDP gather (benchmarks/fsdp_gather.py), with
#    whatever builds of vLLM and torch this Python has.
# Each step has its own time limit (all of them together under 8 minutes), a step that fails or
# cannot run is recorded with its exit status and the tail of its output, and one JSON holds it
# all. Exit status: 0 when every step passed.
set -u
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check.json}
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"

step() {  # step NAME LIMIT_S COMMAND...: run it, keep its status, time and output's tail
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - started)) s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >>"$work/steps.tsv"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >"$work/gpu.txt" 2>&1 || echo "nvidia-smi failed" >"$work/gpu.txt"
step tests 240 "$python" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
  --junitxml="$work/tests.xml" tests
step channel 90 "$python" benchmarks/gpu_channel.py --json "$work/channel.json"
step vllm 120 "$python" benchmarks/vllm_sync.py --rounds 2 --json "$work/vllm.json"
step fsdp_gather 60 "$python" benchmarks/fsdp_gather.py --rounds 3 --json "$work/fsdp_gather.json"

"$python" - "$work" "$out" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {"gpu": (work / "gpu.txt").read_text().strip(), "steps": {}}
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    step = {"exit": int(rc), "seconds": int(seconds)}
    figures = work / f"{name}.json"
    if figures.exists():
        step["figures"] = json.loads(figures.read_text())
    if int(rc) != 0:
        step["output_tail"] = (work / f"{name}.log").read_text()[-3000:]
    result["steps"][name] = step
junit = work / "tests.xml"
if junit.exists():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    result["steps"]["tests"]["junit"] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
out.write_text(json.dumps(result, indent=2))
print(f"wrote {out}")
sys.exit(0 if all(s["exit"] == 0 for s in result["steps"].values()) else 1)
PY
