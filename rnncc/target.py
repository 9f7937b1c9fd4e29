"""Targets rnncc compiles for: ``cuda`` (an SM architecture) and ``llvm`` (this CPU)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

KINDS = ("cuda", "llvm")
DEFAULT_ARCH = "sm_90"
_ARCH = re.compile(r"^sm_[0-9]{2,3}[a-z]?$")


@dataclass(frozen=True)
class TargetSpec:
    """``kind`` is "cuda" or "llvm"; ``arch`` the SM architecture (cuda); ``cpu`` the LLVM CPU
    name (llvm; None means the CPU this runs on)."""

    kind: str = "cuda"
    arch: str | None = None
    cpu: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"unknown target {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind == "cuda":
            arch = self.arch or DEFAULT_ARCH
            if not _ARCH.match(arch):
                raise ConfigError(f"unknown CUDA architecture {arch!r}; expected e.g. sm_80, sm_90")
            object.__setattr__(self, "arch", arch)
        elif self.arch is not None:
            raise ConfigError(f"--arch is for the cuda target, not {self.kind!r}")
        if self.cpu is not None:
            if self.kind != "llvm":
                raise ConfigError(f"--cpu is for the llvm target, not {self.kind!r}")
            _check_cpu(self.cpu)

    def tvm_target(self):
        """The tvm.target.Target (compiler side only)."""
        import tvm
        from tvm.target import codegen

        if self.kind == "cuda":
            return tvm.target.Target(
                {"kind": "cuda", "arch": self.arch, "max_threads_per_block": 1024,
                 "max_shared_memory_per_block": 49152, "thread_warp_size": 32},
                host={"kind": "llvm"},
            )
        cpu = self.cpu or codegen.llvm_get_system_cpu()
        return tvm.target.Target({"kind": "llvm", "mcpu": cpu})

    def describe(self) -> str:
        return f"cuda {self.arch}" if self.kind == "cuda" else f"llvm {self.cpu or 'host'}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "arch": self.arch, "cpu": self.cpu}


def _check_cpu(cpu: str) -> None:
    """A ConfigError unless LLVM knows ``cpu`` for this machine's triple (TVM would otherwise
    print errors and compile for a generic CPU)."""
    import tvm
    from tvm.target import codegen

    triple = codegen.llvm_get_system_triple()
    if not codegen.llvm_is_valid_cpu(cpu, triple):
        known = sorted(codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"})))
        raise ConfigError(f"unknown LLVM CPU {cpu!r} for {triple}; allowed: {', '.join(known)}")
