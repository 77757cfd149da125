"""The CPU shims of SGLang's processes, and the patches timeshare makes to SGLang, against the
real SGLang, torchvision and torch of .venv-sglang.

Each check of what a fresh process imports runs in one (`python -c`), since a shim is applied
once per process: the SGLang venv's .pth file is what applies them there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from timeshare.engines.patches import Outcome, Patch, apply_patches
from timeshare.engines.sglang import cpu_shims, sgl_kernel_standin
from timeshare.engines.sglang.request_stops import REQUEST_STOPS
from timeshare.engines.sglang.seeded_sampling import SEEDED_SAMPLING
from timeshare.errors import PatchRefused

# What a fresh process of the SGLang venv imports and how: printed as one JSON line.
PROBE = """
import json, sys
import sgl_kernel, torchvision, torch
print(json.dumps({
    "sgl_kernel": sgl_kernel.__file__,
    "standin_loaded": "timeshare.engines.sglang.sgl_kernel_standin" in sys.modules,
    "torchvision": torchvision.__version__,
    "murmur": hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"),
    "amx_probe": hasattr(torch.ops.sgl_kernel, "convert_weight_packed"),
}))
"""


def probe(env: dict[str, str] | None = None, pythonpath: Path | None = None) -> dict[str, object]:
    environment = dict(env or {})
    if pythonpath is not None:
        environment["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**_base_env(), **environment},
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TS_PATCHES_OFF", "PYTHONPATH")}


def test_on_a_cpu_only_torch_both_shims_load_as_their_packages_are_imported() -> None:
    seen = probe()
    assert "error" not in seen, seen
    assert seen["sgl_kernel"] == sgl_kernel_standin.__file__
    assert seen["standin_loaded"] is True
    assert str(seen["torchvision"]).startswith("0.28.0")  # imported: its ops were defined first
    assert seen["murmur"] is True
    assert seen["amx_probe"] is False  # SGLang's probe for optional kernels still answers no


def test_a_real_sgl_kernel_is_imported_as_itself_and_the_standin_never_loads(
    tmp_path: Path,
) -> None:
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("KIND = 'real'\n")
    seen = probe(pythonpath=tmp_path)
    assert "error" not in seen, seen
    assert seen["sgl_kernel"] == str(real / "__init__.py")
    assert seen["standin_loaded"] is False


def test_each_shim_is_switchable_and_its_package_then_fails_as_it_would() -> None:
    seen = probe(env={"TS_PATCHES_OFF": "sglang.sgl_kernel_standin"})
    assert "No module named 'sgl_kernel'" in str(seen["error"])
    seen = probe(env={"TS_PATCHES_OFF": "sglang.torchvision_ops"})
    assert "torchvision::nms does not exist" in str(seen["error"])


def test_where_torch_has_an_accelerator_neither_shim_is_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert not cpu_shims.torchvision_lacks_ops()
    assert not cpu_shims.sgl_kernel_missing()
    # Under names of their own: this process may have applied the shims already.
    fresh = [replace(p, name=f"{p.name}.fresh") for p in cpu_shims.SHIM_OF_PACKAGE.values()]
    assert set(apply_patches(fresh).values()) == {Outcome.NOT_NEEDED}


def test_a_shim_written_for_another_version_is_refused_naming_its_target() -> None:
    mismatched = Patch(
        name="sglang.test_mismatch",
        version_of="sglang",
        known=frozenset({"0.4.0"}),
        apply=lambda: pytest.fail("a refused patch must not be applied"),
    )
    with pytest.raises(PatchRefused, match=r"sglang is 0\.5\.23, which it was not written for"):
        apply_patches([mismatched, SEEDED_SAMPLING])


def test_seeded_sampling_knows_the_installed_sglang_source() -> None:
    assert SEEDED_SAMPLING.found() in SEEDED_SAMPLING.known


def test_request_stops_knows_the_installed_sglang_source() -> None:
    assert REQUEST_STOPS.found() in REQUEST_STOPS.known


def test_the_standin_murmur_hash_is_murmurhash3_of_seed_position_and_column() -> None:
    seeds = torch.tensor([7, 2**40 + 3], dtype=torch.int64)
    positions = torch.tensor([0, 5])
    columns = torch.arange(4)
    got = sgl_kernel_standin.murmur_hash32(seeds, positions, columns)
    assert got.dtype == torch.uint32 and got.shape == (2, 4)
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        for column in range(4):
            assert int(got[row, column]) == reference_murmur(seed, position, column)


def test_the_standin_assigns_each_requests_slots_in_order() -> None:
    pool = torch.zeros((3, 8), dtype=torch.int32)
    sgl_kernel_standin.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        pool,
        torch.tensor([1, 0]),
        torch.tensor([4, 2]),
        torch.tensor([11, 12, 13, 21, 22], dtype=torch.int32),
        8,
    )
    assert pool[2, :5].tolist() == [0, 11, 12, 13, 0]
    assert pool[0, :3].tolist() == [21, 22, 0]
    assert pool[1].tolist() == [0] * 8


def test_what_the_standin_lacks_is_loud_naming_itself() -> None:
    kernel = sgl_kernel_standin.fused_experts
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.fused_experts .* stand-in"):
        kernel(torch.zeros(1))


def reference_murmur(seed: int, position: int, column: int) -> int:
    """MurmurHash3 (32 bits) over the blocks seed-low, seed-high, position, column."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    def mix(h: int, k: int) -> int:
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15)
        h ^= (k * 0x1B873593) & 0xFFFFFFFF
        return (rotl(h, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF

    h = 0
    for block in (seed & 0xFFFFFFFF, seed >> 32, position, column):
        h = mix(h, block)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)
