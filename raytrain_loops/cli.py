"""``raytrain-loops``: parse, build the config, call the library. No training logic here."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="raytrain-loops", description="Research training loops on Ray Train.")
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe on Ray Train (a local Ray, or the cluster in RAY_ADDRESS)")
    train.add_argument("recipe", help="built-in recipe name or YAML path")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. loop.epochs=3")
    train.add_argument(
        "--local",
        action="store_true",
        help="local mode: the loop in this process, without Ray (scaling.num_workers=0); pdb and breakpoint() work",
    )
    sweep = sub.add_parser("tune", help="a Ray Tune search over a recipe; every trial a multi-worker Ray Train run")
    sweep.add_argument("recipe", help="built-in recipe name or YAML path")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides of the recipe")
    sweep.add_argument("--sweep", required=True, metavar="FILE", help="the sweep YAML (space, metric, scheduler...)")
    _recipes_and_plan(sub)
    export = sub.add_parser(
        "export",
        help="write a checkpoint (sharded or not) as one state.pt for inference (model, ema, counters), "
        "or, --format hf, as a Hugging Face model directory (hf_lm runs)",
    )
    export.add_argument(
        "checkpoint",
        help="a local checkpoint directory (checkpoint_<step>), or a run directory: its newest intact checkpoint",
    )
    export.add_argument("out", help="the file to write, e.g. state.pt (--format hf: a directory)")
    export.add_argument("--format", choices=["state", "hf"], default="state", help="state.pt, or hf")
    export.add_argument(
        "--checkpoint",
        dest="checkpoint_choice",
        choices=["newest", "best"],
        default="newest",
        help="of a run directory: its newest intact checkpoint, or its best by checkpoint.score_metric (best/)",
    )
    export.add_argument("--ema", action="store_true", help="the EMA's weights as the model's (state.pt's model, or hf)")
    evaluate = sub.add_parser(
        "evaluate",
        help="evaluate a checkpoint on its run's eval split with its run's config (config.yaml beside it), "
        "model and EMA, on Ray (the run's scaling) or --local",
    )
    evaluate.add_argument("checkpoint", help="a run's checkpoint directory (runs/<run>/checkpoint_<step>)")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the run's config")
    evaluate.add_argument("--local", action="store_true", help="in this process, without Ray (scaling.num_workers=0)")
    evaluate.add_argument("--out", default=None, metavar="FILE", help="also write the metrics as one JSON object")
    submit = sub.add_parser("submit", help="train a recipe on a Ray cluster through the Ray Jobs API")
    submit.add_argument("recipe", help="built-in recipe name or YAML path (inside --working-dir)")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    submit.add_argument(
        "--address", default=None, help="the dashboard URL (default: RAY_ADDRESS or http://127.0.0.1:8265)"
    )
    submit.add_argument("--working-dir", default=None, help="a directory uploaded as the job's working directory")
    submit.add_argument("--pip", action="append", default=None, help="a pip requirement for the job (repeatable)")
    submit.add_argument("--no-wait", action="store_true", help="return once submitted instead of following the logs")
    for command in (train, sweep, submit):
        command.add_argument(
            "--verbose",
            action="store_true",
            help="show Ray's own output (logging.verbose=true); otherwise it goes to ray.log in the run directory",
        )
    return ap


def _recipes_and_plan(sub: argparse._SubParsersAction) -> None:
    """The verbs that read recipes without running one, and the conversion of a data set."""
    sub.add_parser("recipes", help="list the built-in recipes")
    plan = sub.add_parser(
        "plan",
        help="the memory of one worker before a run, without Ray: parameters, gradients and optimizer state "
        "under DDP and FSDP (computed), the activations of one micro-batch (measured: one update on this CPU)",
    )
    plan.add_argument("recipe", help="built-in recipe name or YAML path")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, as train takes them")
    _convert_parser(sub)


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser(
        "convert",
        help="turn an image data set (an ImageFolder tree, a COCO directory) into the Parquet the recipes read, "
        "once, on Ray Data (a local Ray, or the cluster in RAY_ADDRESS)",
    )
    convert.add_argument("format", choices=["imagefolder", "coco"], help="the source's format")
    convert.add_argument("source", help="the source directory: a local path or a URI (s3://...)")
    convert.add_argument("dest", help="the converted set's directory: a local path or a URI")
    convert.add_argument("--strict", action="store_true", help="refuse a file that is not an image instead of skipping it")
    convert.add_argument(
        "--chunk-rows", type=int, default=None, metavar="N",
        help="rows per Parquet row group: the run's data.shuffle_chunk_rows (default 128)",
    )  # fmt: skip
    convert.add_argument("--rows-per-file", type=int, default=None, metavar="N", help="rows per file (default 1024)")
    convert.add_argument("--num-cpus", type=int, default=None, metavar="N", help="a local Ray's CPUs (default: all)")


def _convert(args: argparse.Namespace, argv: list[str]) -> int:
    """``convert``: the summary line printed; bad input is exit code 2 naming it."""
    from raytrain_loops.data.formats.layout import SourceError
    from raytrain_loops.tools import convert

    sizes = {"chunk_rows": args.chunk_rows or convert.CHUNK_ROWS, "rows_per_file": args.rows_per_file or convert.ROWS_PER_FILE}
    try:
        summary = convert.convert(
            args.format, args.source, args.dest, strict=args.strict, num_cpus=args.num_cpus, **sizes
        )
    except (SourceError, FileNotFoundError) as err:
        return _error(str(err))
    print(summary.line())
    return 0


def _error(message: str) -> int:
    print(f"raytrain-loops: error: {message}", file=sys.stderr)
    return 2


def _recipes(args: argparse.Namespace, argv: list[str]) -> int:
    from raytrain_loops import recipes

    for name, path in sorted(recipes.builtin().items()):
        print(f"{name:<16} {recipes.describe(path)}")
    return 0


def _plan(args: argparse.Namespace, argv: list[str]) -> int:
    """``plan``: the memory plan printed; a bad recipe, override or data is exit code 2 naming it."""
    from raytrain_loops import recipes
    from raytrain_loops.config import ConfigError, load_config

    try:  # refused before torch is imported, as train's
        config = load_config(recipes.resolve(args.recipe), args.overrides)
    except ConfigError as err:
        return _error(str(err))
    from raytrain_loops.driver.preflight import DataError
    from raytrain_loops.tools.memory_plan import make_plan, render

    try:
        print(render(make_plan(config, args.recipe)))
    except (ConfigError, DataError) as err:
        return _error(str(err))
    return 0


def _export(args: argparse.Namespace, argv: list[str]) -> int:
    from raytrain_loops.checkpoint import CheckpointError, export, exported_checkpoint
    from raytrain_loops.config import ConfigError

    try:
        checkpoint, why = exported_checkpoint(args.checkpoint, args.checkpoint_choice)
        if checkpoint != args.checkpoint:
            print(f"exporting {checkpoint} ({why})")
        if args.format == "hf":
            from raytrain_loops.tools.export_hf import export_hf

            counters = export_hf(checkpoint, args.out, ema=args.ema)
            print(f"wrote {args.out}: a Hugging Face model and tokenizer at step {counters.get('step', '?')}")
            return 0
        written = export(checkpoint, args.out, ema=args.ema)
    except (CheckpointError, FileNotFoundError, ConfigError) as err:
        return _error(f"cannot export {args.checkpoint}: {err}")
    step = written["counters"].get("step", "?")
    weights = "the EMA's weights as model" if args.ema else "model tensors"
    print(f"wrote {args.out}: {len(written['model'])} {weights} at step {step}")
    return 0


def _evaluate(args: argparse.Namespace, argv: list[str]) -> int:
    """``evaluate``: the metrics printed (and written to ``--out``); a path that is not a run's
    intact checkpoint, or a bad override, is exit code 2 naming it."""
    import json

    from raytrain_loops.checkpoint import CheckpointError
    from raytrain_loops.config import ConfigError
    from raytrain_loops.driver.evaluate import EvaluateError, evaluate_checkpoint
    from raytrain_loops.driver.preflight import DataError

    try:
        metrics = evaluate_checkpoint(args.checkpoint, args.overrides)
    except (EvaluateError, ConfigError, DataError, CheckpointError) as err:
        return _error(f"cannot evaluate {args.checkpoint}: {err}")
    except Exception as err:  # a failed evaluation: the worker's traceback and its root cause
        return _failed("evaluate", err, local="scaling.num_workers=0" in args.overrides)
    shown = ", ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()) if k.startswith("eval_"))
    print(f"checkpoint {args.checkpoint} (step {metrics.get('step')}): {shown}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"checkpoint": args.checkpoint, **metrics}) + "\n")
        print(f"wrote {args.out}")
    return 0


def _submit(args: argparse.Namespace, argv: list[str]) -> int:
    import os

    from raytrain_loops.config import ConfigError
    from raytrain_loops.jobs.submit import submit

    address = args.address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    try:
        return submit(args.recipe, args.overrides, address, args.working_dir, args.pip, wait=not args.no_wait)
    except ConfigError as err:
        return _error(str(err))
    except (RuntimeError, ConnectionError) as err:  # refused, unreachable, unauthenticated
        print(f"raytrain-loops: submission to {address} failed: {err}", file=sys.stderr)
        return 1


def _train_or_tune(args: argparse.Namespace, argv: list[str]) -> int:
    """``train`` and ``tune``: a bad config or data is exit code 2, an interruption names the
    command that resumes the run (128 + the signal), a failed run prints the worker's traceback."""
    from raytrain_loops import recipes
    from raytrain_loops.config import ConfigError, load_config

    again = shlex.join(["raytrain-loops", *argv])
    try:  # a bad recipe or override is refused before torch and Ray are imported (seconds)
        config = load_config(recipes.resolve(args.recipe), args.overrides)
    except ConfigError as err:
        return _error(str(err))
    from raytrain_loops.driver.fit import RunInterrupted
    from raytrain_loops.driver.preflight import DataError
    from raytrain_loops.sweeps.results import SweepFailed

    try:
        if args.command == "tune":
            from raytrain_loops.sweeps.tune import tune

            swept = tune(config, args.sweep)
        else:
            from raytrain_loops.driver.fit import fit

            result = fit(config)
    except (ConfigError, DataError) as err:
        return _error(str(err))
    except RunInterrupted as stop:  # Ray Train stopped the workers; the same command resumes the run
        print(f"raytrain-loops: {stop}", file=sys.stderr)
        print(f"resume it with the same command: {again}", file=sys.stderr)
        return 128 + stop.signum
    except SweepFailed as failed:  # everything written; the failed trials named, with their errors
        print(f"sweep directory: {failed.result.sweep_dir}")
        print(f"raytrain-loops: tune: {failed}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # a sweep's names the trials the same command resumes
        said = f"{stop}" if str(stop) else f"{args.command} interrupted"
        print(f"raytrain-loops: {said}; the same command runs it again: {again}", file=sys.stderr)
        return 130
    except Exception as err:  # a failed run: the worker's traceback and its root cause, not Ray's wrapping
        return _failed(args.command, err, local=config.scaling.local)
    if args.command == "tune":
        print(f"sweep directory: {swept.sweep_dir}")
        return 0
    if result.trained:  # a finished run's rerun said what it holds
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()) if k.startswith("eval_"))
        print(f"finished in {result.wall_time:.1f}s: {shown}")
    print(f"run directory: {result.run_dir}")
    return 0


def _failed(command: str, err: Exception, local: bool = False) -> int:
    from raytrain_loops.console.deaths import deaths
    from raytrain_loops.errors import root_cause, worker_traceback

    died = deaths(getattr(err, "worker_failures", None) or {})
    if died:  # no traceback to show: Ray's text is in ray.log (the controller's line of it)
        print(f"raytrain-loops: {command} failed: {'; '.join(d.line(r) for r, d in died.items())}", file=sys.stderr)
        return 1
    trace = worker_traceback(err)
    if local:  # raised in this process: its own traceback, the task's frame last
        trace = "".join(traceback.format_exception(err))
    if trace:
        print(trace.rstrip(), file=sys.stderr)
    print(f"raytrain-loops: {command} failed: {root_cause(err)}", file=sys.stderr)
    return 1


VERBS = {
    "recipes": _recipes,
    "plan": _plan,
    "convert": _convert,
    "export": _export,
    "evaluate": _evaluate,
    "submit": _submit,
    "train": _train_or_tune,
    "tune": _train_or_tune,
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as the verbs get it: overrides wherever they stand among the flags, and the
    flags that are overrides (``--verbose``, ``--local``) added to them. Exits 2 on a bad line."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)  # overrides after an option (train --local a=1) come back here
    if rest and (not hasattr(args, "overrides") or any(r.startswith("-") for r in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    if getattr(args, "verbose", False):
        args.overrides = [*args.overrides, "logging.verbose=true"]
    if getattr(args, "local", False):
        args.overrides = [*args.overrides, "scaling.num_workers=0"]
    return args


def _current_directory_on_path() -> None:
    """A task module beside the user (``task.name=mytask:MyTask``) imports as it would in a script
    run from there: the current directory on this process's path and, through the environment
    that a local Ray's processes inherit, on its workers' (a cluster's workers get it from
    ``submit --working-dir``)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *paths])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    _current_directory_on_path()
    return VERBS[args.command](args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
