"""``rnncc compile | cells | inspect | bench | tune``.

Bad arguments give one line on stderr, ``rnncc: error: ...``, and exit status 2; a build
failure exits with 1. Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise _CliError(message)


_TF32_HELP = ("float32 products may run on tensor cores in TF32 (10-bit mantissas, float32 "
             "sums), as torch's allow_tf32; default IEEE float32")
_TF32X3_HELP = ("float32 products of many rows on tensor cores as three TF32 products each "
                "(IEEE float32's error; default on)")


class _CliError(Exception):
    pass


def _add_problem_args(p):
    p.add_argument("cell", help="a registered cell (see `rnncc cells`) or a cell file (.py)")
    p.add_argument("--input-size", "-C", type=int, required=True, help="C, input features")
    p.add_argument("--hidden-size", "-H", type=int, required=True, help="H, hidden units")
    p.add_argument("--batch", "-N", type=int, required=True, help="N, batch size")
    p.add_argument("--dtype", default="float32",
                   help="storage dtype: float32, float16 or bfloat16 (half storage, float32 "
                        "math)")
    p.add_argument("--target", default="cuda", help="cuda or llvm (this CPU)")
    p.add_argument("--arch", default=None, help="CUDA architecture (default sm_90)")
    p.add_argument("--cpu", default=None, help="LLVM CPU name for --target llvm (default: host)")
    for flag, what in (("input-gemm", "the input projection of all steps as one GEMM"),
                       ("gate-gemm", "the gates' projections as one GEMM"),
                       ("fuse-pointwise", "the cell's point-wise step in one kernel"),
                       ("fused-step", "CUDA sm_90: a step's recurrent product and cell in one "
                                      "kernel where faster")):
        p.add_argument(f"--{flag}", dest=flag.replace("-", "_"), default=True,
                       action=argparse.BooleanOptionalAction, help=f"{what} (default on)")
    p.add_argument("--persistent", choices=("auto", "on", "off"), default="auto",
                   help="the persistent-weight CUDA kernel: where it fits (auto), required (on), "
                        "or never (off)")
    p.add_argument("--lengths", action="store_true",
                   help="the module takes each sample's length at run time (1 to T)")
    p.add_argument("--bidirectional", action="store_true",
                   help="bidirectional layers: both directions in one module (y [T, N, 2*H])")
    p.add_argument("--layers", "-L", type=int, default=1,
                   help="L stacked layers, as torch's num_layers: L > 1 writes one network "
                        "file (rnncc.load gives the whole network)")
    p.add_argument("--proj-size", "-P", type=int, default=0,
                   help="LSTM with projections (LSTMP, torch's proj_size): h = W_hr h', P wide "
                        "(weights weight_hr_l0 [P, H]; default 0: none)")
    p.add_argument("--allow-tf32", action="store_true", help=_TF32_HELP)
    p.add_argument("--tf32x3", default=True, action=argparse.BooleanOptionalAction,
                   help=_TF32X3_HELP)


def _add_tuning_args(p):
    p.add_argument("--gpu", default=None,
                   help="GPU kind whose tuning logs apply, e.g. h100, h200 (default: this "
                        "machine's GPU)")
    p.add_argument("--tuning-log", default=None,
                   help="apply this tuning log directory (refused if it does not fit)")
    p.add_argument("--no-tuning-logs", action="store_true",
                   help="ignore tuning logs (the untuned schedules)")


def _tuning(args) -> str:
    if args.no_tuning_logs and args.tuning_log:
        raise _CliError("--tuning-log and --no-tuning-logs exclude each other")
    return "off" if args.no_tuning_logs else (args.tuning_log or "auto")


def _parser():
    parser = _Parser(prog="rnncc", description="A TVM-based compiler for recurrent networks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("compile", help="compile a cell into a module file (a network file for "
                                       "several layers)")
    _add_problem_args(p)
    p.add_argument("-o", "--output", required=True,
                   help="module file to write (.so; a network file, .rnet, for --layers > 1)")
    _add_tuning_args(p)

    sub.add_parser("cells", help="list the registered cells")

    p = sub.add_parser("inspect", help="show a module file's metadata")
    p.add_argument("file")
    p.add_argument("--source", choices=("cuda", "tir"), help="print the generated source too")

    p = sub.add_parser("bench", help="time a module (and cuDNN on a GPU with PyTorch)")
    p.add_argument("module", help="a module file, or a cell to compile (then give the sizes)")
    p.add_argument("--input-size", "-C", type=int)
    p.add_argument("--hidden-size", "-H", type=int)
    p.add_argument("--batch", "-N", type=int)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", default="cuda")
    p.add_argument("--arch", default=None)
    p.add_argument("--proj-size", "-P", type=int, default=0,
                   help="LSTM with projections (LSTMP): h P wide (default 0: none)")
    p.add_argument("--allow-tf32", action="store_true", help=_TF32_HELP)
    p.add_argument("--tf32x3", default=True, action=argparse.BooleanOptionalAction,
                   help=_TF32X3_HELP)
    p.add_argument("--steps", "-T", type=int, default=100, help="sequence length (100)")
    p.add_argument("--repeat", type=int, default=100, help="timed runs (median)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_tuning_args(p)

    p = sub.add_parser("tune", help="tune a configuration on this machine's GPU (or CPU) and "
                                    "write its tuning log")
    p.add_argument("cell", help="a registered cell or a cell file (.py)")
    p.add_argument("--input-size", "-C", type=int, required=True)
    p.add_argument("--hidden-size", "-H", type=int, required=True)
    p.add_argument("--batch", "-N", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", default="cuda", help="cuda (this GPU) or llvm (this CPU)")
    p.add_argument("--arch", default=None)
    p.add_argument("--cpu", default=None)
    p.add_argument("--trials", type=int, default=64, help="MetaSchedule trials (64)")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds for the whole tune (300)")
    p.add_argument("--log-dir", default="tuning_logs", help="where the log goes (tuning_logs)")
    p.add_argument("--work-dir", default=None,
                   help="measurements kept for resuming, one configuration's a "
                   "directory (~/.cache/rnncc/tune/<device>/<config>)")
    p.add_argument("--steps", "-T", type=int, default=100, help="sequence length timed (100)")
    p.add_argument("--allow-tf32", action="store_true",
                   help="tune the float32 module that allows TF32 (its own log)")
    p.add_argument("--bidirectional", action="store_true",
                   help="tune the bidirectional layer (its own log)")
    p.add_argument("--layers", "-L", type=int, default=1,
                   help="tune the wavefront of this many layers of input size H (its own log)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT:KEY",
                   help="measure MetaSchedule candidates on the servers of a TVM RPC tracker")
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    return parser


def _problem_kwargs(args) -> dict:
    return dict(input_size=args.input_size, hidden_size=args.hidden_size, batch=args.batch,
                dtype=args.dtype, target=args.target, arch=args.arch,
                cpu=getattr(args, "cpu", None), input_gemm=args.input_gemm,
                gate_gemm=args.gate_gemm, fuse_pointwise=args.fuse_pointwise,
                fused_step=args.fused_step, persistent=args.persistent, gpu=args.gpu,
                tuning=_tuning(args),
                lengths=getattr(args, "lengths", False),
                directions=2 if getattr(args, "bidirectional", False) else 1,
                **({"proj_size": args.proj_size} if getattr(args, "proj_size", 0) else {}),
                **({"allow_tf32": True} if args.allow_tf32 else {}),
                **({} if getattr(args, "tf32x3", True) else {"tf32x3": False}))


def _check_writable(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _CliError(f"cannot write {path}: directory {directory} does not exist")
    if os.path.isdir(path):
        raise _CliError(f"cannot write {path}: it is a directory")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _CliError(f"cannot write {path}: permission denied")


def _cmd_compile(args) -> int:
    import rnncc

    _check_writable(args.output)
    if args.layers < 1:
        raise _CliError(f"--layers must be at least 1, got {args.layers}")
    if args.layers > 1:
        return _compile_network(args)
    module = rnncc.compile(args.cell, **_problem_kwargs(args))
    module.export(args.output)
    meta = module.metadata
    print(f"compiled {_summary(meta)}")
    _print_details(meta)
    print(f"wrote {os.path.abspath(args.output)} ({os.path.getsize(args.output)} bytes)")
    return 0


def _compile_network(args) -> int:
    import rnncc

    kwargs = _problem_kwargs(args)
    network = rnncc.compile_network(args.cell, kwargs.pop("input_size"),
                                    kwargs.pop("hidden_size"), kwargs.pop("batch"),
                                    layers=args.layers, **kwargs)
    network.export(args.output)
    print(f"compiled {_network_summary(network.metadata)}")
    for stage in network.stages:
        print(f"  {_stage_line(stage.kind, stage.first, stage.count)}: "
              f"{_summary(stage.module.metadata)}")
        _print_details(stage.module.metadata, indent="    ")
    print(f"wrote {os.path.abspath(args.output)} ({os.path.getsize(args.output)} bytes)")
    return 0


def _print_details(meta: dict, indent: str = "  ") -> None:
    rules = ", ".join(f"{k}={v}" for k, v in sorted(meta["schedule"]["rules"].items()))
    print(f"{indent}rules: {rules}")
    for note in meta["schedule"]["notes"]:
        print(f"{indent}note: {note}")
    print(f"{indent}tuning: {_tuning_line(meta)}")


def _network_summary(meta: dict) -> str:
    return (f"{meta['cell']} network C={meta['input_size']} H={meta['hidden_size']} "
            f"L={meta['layers']}{' bidirectional' if meta['directions'] == 2 else ''} "
            f"N={meta['batch']} {meta['dtype']}{_tf32(meta)}"
            f"{' with lengths' if meta['lengths'] else ''} "
            f"{meta['target']['kind']} {meta['target']['arch'] or ''}").rstrip()


def _tf32(meta: dict) -> str:
    """The float32 products' precision where not IEEE on the CUDA cores: TF32, or the
    products that run as three TF32 products (tf32x3)."""
    if meta.get("allow_tf32"):
        return " (TF32 allowed)"
    split = [key for key, rule in meta.get("schedule", {}).get("rules", {}).items()
             if rule in ("cuda.mma_gemm", "cuda.wgmma_gemm")]
    if meta["dtype"] != "float32" or not split:
        return ""
    return f" ({', '.join(split)} as three TF32 products: tf32x3)"


#: The CUDA rules that take any product, far slower than the others (dlight's Matmul, and
#: one thread an output): a product that falls to them is off the others' sizes.
GENERIC_GEMMS = ("cuda.matmul", "cuda.gemm_simple")


def _generic(meta: dict) -> str:
    """The products on a generic GEMM rule (:data:`GENERIC_GEMMS`), as a clause; ''."""
    slow = [key for key, rule in sorted(meta.get("schedule", {}).get("rules", {}).items())
            if rule in GENERIC_GEMMS]
    if not slow:
        return ""
    return (f"; {', '.join(slow)} on a generic GEMM rule (several times slower; the schedule's "
            "notes name the rules that do not take it)")


def _stage_line(kind: str, first: int, count: int) -> str:
    if kind == "layers":
        return f"layers {first}-{first + count - 1} as one wavefront launch"
    if kind == "split":
        return f"layer {first}, one direction after the other"
    return f"layer {first}"


def _cmd_cells(args) -> int:
    from rnncc import cells
    from rnncc.cells.autodiff import takes_means, trace

    for cell in cells.registry().values():
        notes = [f"{len(cell.params)} per-unit parameters"] if cell.params else []
        if takes_means(cell):
            notes.append("means over the hidden units (ops.mean): persistent in inference "
                         "and a training forward, one layer a module")
        if trace(cell).products:
            notes.append("a recurrent product of a value of its step (ops.recurrent): "
                         "persistent in inference and training, one layer a module")
        print(f"{cell.name:<12} G={cell.gates} states={','.join(cell.states):<6} {cell.doc}"
              + "".join(f"; {note}" for note in notes))
    return 0


def _summary(meta: dict) -> str:
    """One line: what the module computes, and which schedule runs it (or why not the
    persistent kernel)."""
    schedule, layers = meta["schedule"], meta.get("layers", 1)
    head = (f"{meta['cell']} C={meta['input_size']} H={meta['hidden_size']} "
            + (f"P={meta['proj_size']} " if meta.get("proj_size") else "") + f"N={meta['batch']} "
            f"{meta['dtype']}{_tf32(meta)}"
            f"{' bidirectional' if meta.get('directions', 1) == 2 else ''}"
            f"{f' {layers} layers' if layers > 1 else ''}"
            f"{' with lengths' if meta.get('lengths') else ''} "
            f"{meta['target']['kind']} {meta['target']['arch'] or ''}").rstrip()
    persistent = schedule.get("persistent", {})
    if schedule["kind"] == "persistent":
        plan = persistent["plan"]
        streamed = plan.get("streamed_bytes", 0)
        extra = f", {streamed / 2**20:.1f} MiB of weights read from L2 a step" if streamed else ""
        groups = plan.get("batch_groups", 1)
        if groups > 1:
            extra += f", {groups} batch groups of {meta['batch'] // groups}"
        return (f"{head}: persistent kernel, {plan['blocks']} blocks x {plan['threads']} threads, "
                f"{plan['sync']} exchange{extra} (planned for {persistent['planned_for']}); "
                + ("non-persistent schedule as fallback" if "forward" in meta["functions"]
                   else "no non-persistent schedule") + _generic(meta))
    return (f"{head}: non-persistent schedule ({persistent.get('reason', 'n/a')})"
            + _generic(meta))


def _tuning_line(meta: dict) -> str:
    info = meta.get("tuning") or {}
    if not info.get("log"):
        return f"no log ({info.get('reason', 'n/a')})"
    applied = info.get("applied", {})
    sibling = (f"; the {info['device']} log, for {info['for_device']}"
               if info.get("for_device") else "")
    return (f"{info['match']} log {info['log']} (knobs {applied.get('knobs') or 'default'}, "
            f"tuned components {applied.get('components') or 'none'}{sibling})")


def _cmd_inspect(args) -> int:
    from rnncc.runtime import metadata as md
    from rnncc.runtime import network

    if network.is_network_file(args.file):
        return _inspect_network(args)
    meta = md.read_metadata(args.file)
    print(f"{_summary(meta)}; tuning: {_tuning_line(meta)}")
    print(json.dumps(meta, indent=2, sort_keys=True))
    if args.source:
        section = md.CUDA if args.source == "cuda" else md.TIR
        sections = md.read_sections(args.file)
        if section not in sections:
            raise _CliError(f"{args.file} has no {args.source} source "
                            f"(a {meta['target']['kind']} module)")
        print(sections[section].decode())
    return 0


def _inspect_network(args) -> int:
    from rnncc.runtime import network

    if args.source:
        raise _CliError(f"{args.file} is a network file of several layer modules; --source "
                        "shows one module's (export one with rnncc compile without --layers)")
    manifest = network.read_manifest(args.file)
    modules = manifest["modules"]
    print(_network_summary(manifest))
    for stage in manifest["stages"]:
        line = _stage_line(stage["kind"], stage["first"], stage["count"])
        print(f"  {line}: {_summary(modules[stage['module']])}")
        if stage.get("fallback"):
            print(f"    where it cannot run: {_summary(modules[stage['fallback']])}")
    print(json.dumps(manifest, indent=2, sort_keys=True))
    return 0


def _cmd_bench(args) -> int:
    import rnncc
    from rnncc import bench

    if os.path.isfile(args.module) and not args.module.endswith(".py"):
        module = rnncc.load(args.module)
    else:
        missing = [f"--{n}" for n in ("input-size", "hidden-size", "batch")
                   if getattr(args, n.replace("-", "_")) is None]
        if missing:
            raise _CliError(f"bench of a cell needs {', '.join(missing)} (or give a module file)")
        module = rnncc.compile(args.module, input_size=args.input_size,
                               hidden_size=args.hidden_size, batch=args.batch, dtype=args.dtype,
                               target=args.target, arch=args.arch, gpu=args.gpu,
                               tuning=_tuning(args), **({"proj_size": args.proj_size}
                                                        if args.proj_size else {}),
                               **({"allow_tf32": True} if args.allow_tf32 else {}),
                               **({} if args.tf32x3 else {"tf32x3": False}))
    if args.steps < 1 or args.repeat < 1:
        raise _CliError("--steps and --repeat must be positive")
    layers = getattr(module, "layers", 1)
    proj = module.metadata.get("proj_size", 0)
    what = (f"{module.cell} C={module.input_size} H={module.hidden_size}"
            f"{f' P={proj}' if proj else ''}{f' L={layers}' if layers > 1 else ''}"
            f"{' bidirectional' if module.directions == 2 else ''} N={module.batch} "
            f"{module.dtype}{_tf32(module.metadata)} T={args.steps}")
    if module.target == "cuda":
        result = bench.time_gpu(module, args.steps, args.repeat)
    else:
        result = {"rnncc": bench.time_cpu(module, args.steps, min(args.repeat, 20)),
                  "cudnn": None}
    result.update(problem=what, target=module.target, steps=args.steps)
    if args.json:
        print(json.dumps(result))
        return 0
    per = 1e3 / args.steps
    line = f"{what} on {result.get('device', 'this CPU')}: rnncc {result['rnncc']:.4f} ms " \
           f"({result['rnncc'] * per:.2f} us/step)"
    if result["cudnn"] is not None:
        line += (f", cuDNN {result['cudnn']:.4f} ms ({result['cudnn'] * per:.2f} us/step), "
                 f"speed-up {result['cudnn'] / result['rnncc']:.2f}x")
    print(line)
    return 0


def _cmd_tune(args) -> int:
    from rnncc.tuning import tune

    summary = tune(args.cell, args.input_size, args.hidden_size, args.batch, dtype=args.dtype,
                   target=args.target, arch=args.arch, cpu=args.cpu, trials=args.trials,
                   time_budget=args.time_budget, log_dir=args.log_dir, work_dir=args.work_dir,
                   steps=args.steps, rpc=args.rpc, allow_tf32=args.allow_tf32,
                   directions=2 if args.bidirectional else 1, layers=args.layers,
                   progress=lambda line: print(f"[tune] {line}", flush=True))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


def main(argv=None) -> int:
    from rnncc.errors import BuildError, RnnccError

    try:
        args = _parser().parse_args(argv)
        return {"compile": _cmd_compile, "cells": _cmd_cells, "inspect": _cmd_inspect,
                "bench": _cmd_bench, "tune": _cmd_tune}[args.command](args)
    except _CliError as err:
        print(f"rnncc: error: {err}", file=sys.stderr)
        return 2
    except BuildError as err:
        print(f"rnncc: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    except RnnccError as err:
        print(f"rnncc: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `rnncc cells | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("rnncc: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("rnncc: error: out of memory", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - the one path for anything else: no traceback
        if os.environ.get("RNNCC_DEBUG"):
            raise
        text = str(err).strip().splitlines()
        if "bad_alloc" in str(err):
            print("rnncc: error: out of memory", file=sys.stderr)
            return 1
        print(f"rnncc: internal error: {type(err).__name__}: {text[-1] if text else ''} "
              "(RNNCC_DEBUG=1 shows the traceback; please report it)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
