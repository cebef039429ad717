"""Check which parts of the agent's stack survive MemoryDenyWriteExecute=yes on this host.

The agent unit leaves MemoryDenyWriteExecute off (docs/systemd.md). This probe lets an
operator test that choice on a real GPU node without installing a unit: each step runs in a
fresh child process under the same restriction systemd would apply, either systemd 252's
seccomp filter (refuse mmap with PROT_WRITE|PROT_EXEC, any mprotect/pkey_mprotect adding
PROT_EXEC, shmat with SHM_EXEC) or the kernel's prctl(PR_SET_MDWE) that systemd >= 255 uses.

    python systemd/mdwe-probe.py --mode seccomp            # CPU steps
    python systemd/mdwe-probe.py --mode seccomp --cuda     # plus CUDA and Triton steps
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import tempfile

STEPS = {
    "ctypes_callback": "import ctypes; f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)"
    "(lambda x: x + 1); assert f(41) == 42",
    "torch_import": "import torch",
    "inductor_cpu": "import torch; torch.set_num_threads(1); "
    "g = torch.compile(lambda x: torch.sin(x) * 2 + x); g(torch.ones(8))",
}
CUDA_STEPS = {
    "cuda_matmul": "import torch; a = torch.ones(64, 64, device='cuda'); (a @ a).sum().item()",
    "inductor_cuda": "import torch; g = torch.compile(lambda x: torch.sin(x) * 2 + x); "
    "g(torch.ones(1024, device='cuda')).sum().item()",
}


def _install_seccomp() -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)

    class Arg(ctypes.Structure):
        _fields_ = [
            ("arg", ctypes.c_uint),
            ("op", ctypes.c_int),
            ("a", ctypes.c_uint64),
            ("b", ctypes.c_uint64),
        ]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(Arg),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    masked_eq, allow, deny_eperm = 7, 0x7FFF0000, 0x00050000 | 1
    wx, x, shm_exec = mmap.PROT_WRITE | mmap.PROT_EXEC, mmap.PROT_EXEC, 0o100000
    ctx = lib.seccomp_init(allow)
    for name, mask in [("mmap", wx), ("mprotect", x), ("pkey_mprotect", x), ("shmat", shm_exec)]:
        rule = (Arg * 1)(Arg(2, masked_eq, mask, mask))
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if lib.seccomp_rule_add_array(ctx, deny_eperm, nr, 1, rule) != 0:
            raise OSError(f"seccomp rule for {name} rejected")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")


def _install_prctl() -> None:
    pr_set_mdwe, refuse_exec_gain = 65, 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_mdwe, refuse_exec_gain, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_MDWE) failed (kernel older than 6.3?)")


def _child(mode: str, code: str) -> None:
    if mode == "seccomp":
        _install_seccomp()
    elif mode == "prctl":
        _install_prctl()
    if mode != "none":
        try:  # the restriction must bite, or the probe proves nothing
            mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        except OSError:
            pass
        else:
            raise SystemExit("restriction not active: a W+X mapping was allowed")
    exec(code, {})  # only the fixed snippets above


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["seccomp", "prctl", "none"], default="seccomp")
    parser.add_argument("--cuda", action="store_true", help="also run the CUDA/Triton steps")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = {**STEPS, **CUDA_STEPS}
    if args.child:
        _child(args.mode, steps[args.child])
        return 0
    failed = 0
    chosen = {**STEPS, **(CUDA_STEPS if args.cuda else {})}
    with tempfile.TemporaryDirectory() as cache:  # a cold compile cache: real JIT work
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        for name in chosen:
            proc = subprocess.run(
                [sys.executable, __file__, "--mode", args.mode, "--child", name],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            tail = (proc.stderr.strip().splitlines() or [""])[-1]
            print(f"{name:16} {'ok' if proc.returncode == 0 else 'FAILED'}  {tail[:120]}")
            failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
