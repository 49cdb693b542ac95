"""vLLM's CPU attention uses AMX without asking Linux for it; raykv's plugin asks.

On an AMX host (``amx_tile`` in ``/proc/cpuinfo``) a vLLM 0.32 CPU engine whose
first forward pass has a single new token died with SIGILL (worker exit code
-4): that is a fresh replica whose first prompt raykv serves whole, and it broke
the Serve router test's added replica. Elsewhere both tests still run and must
pass (the plugin's request then fails harmlessly).
"""

from __future__ import annotations

import gc
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm_engine]

ARCH_GET_XCOMP_PERM = 0x1022


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_the_plugin_is_what_vllm_loads() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "raykv"]
    assert ep.value == "raykv.integrations.vllm.plugin:register"


@pytest.mark.skipif(not _has_amx(), reason="needs an AMX host")
def test_the_plugin_grants_this_process_amx_tile_state() -> None:
    # A fresh interpreter: this test process may hold the permission already.
    code = (
        "import ctypes\n"
        "from raykv.integrations.vllm.plugin import register\n"
        "libc = ctypes.CDLL(None)\n"
        "def perm():\n"
        "    mask = ctypes.c_uint64(0)\n"
        f"    assert libc.syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(mask)) == 0\n"
        "    return bool(mask.value >> 18 & 1)\n"
        "before = perm()\n"
        "register()\n"
        "print(before, perm())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True"], out


def test_an_engine_whose_first_pass_is_one_token_answers(vllm_env, tiny_model) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=tiny_model, max_model_len=2048, num_gpu_blocks_override=20, enforce_eager=True)
    try:
        (out,) = llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
