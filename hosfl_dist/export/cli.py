"""``python -m hosfl_dist.export RUN_DIR [--checkpoint latest|round-N] --out DIR [--format merged|peft]``.

The checkpoint is restored (:func:`~hosfl_dist.export.restore.restore`: verified, checked against the run, both
parts loaded), written into a hidden folder beside DIR, and renamed to DIR once complete, so DIR never holds half an
export: a crash or a full disk leaves DIR as it was. Formats: ``merged`` (default for LMs) and ``peft`` for a split
decoder LM (:mod:`~hosfl_dist.export.hf`); ``state_dict`` (the only one, and the default) for a vision model
(:mod:`~hosfl_dist.export.vision`). Every export also holds the model card (README.md), hosfl_export.json and, written
last, hosfl_manifest.json: every file's size and hash, signed with the user's key (what predict and load_vision
verify). The checkpoint's own manifest must be signed by that key (``--allow-unsigned`` accepts an unsigned one).

Bad input (no run, no checkpoint, one that fails verification, a checkpoint of another model, a base model that
changed, a DIR that exists or cannot be written) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hosfl_dist.errors import HosflError, write_failure
from hosfl_dist.export.restore import ExportError, restore
from hosfl_dist.runtime.process.host import pid_alive
from hosfl_dist.safe_files import readable

FORMATS = ("merged", "peft", "state_dict")
DEFAULT_SHARD = "2GB"


def export(
    run_dir: str | Path,
    out: str | Path,
    checkpoint: str = "latest",
    fmt: str | None = None,
    max_shard_size: str = DEFAULT_SHARD,
    force: bool = False,
    command: str = "",
    allow_unsigned: bool = False,
    copy_base: bool = False,
) -> dict[str, Any]:
    """Export checkpoint ``checkpoint`` of the run in ``run_dir`` to the folder ``out``; returns hosfl_export.json's
    record. ``fmt`` None: ``merged`` for an LM, ``state_dict`` for a vision model. ``force`` replaces an ``out``
    that holds files (only once the new export is complete). ``allow_unsigned``: export a checkpoint whose manifest
    carries no signature (a signature mismatch is refused whatever it says). ``copy_base`` (peft): the base goes into
    ``out/base``, named by that relative path, instead of being named by its source. Each step is logged as it starts
    and ends; the files get the modes the umask says."""
    run_dir, out = run_folder(Path(run_dir)), Path(out)
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from transformers.utils.hub import convert_file_size_to_int

    try:
        convert_file_size_to_int(max_shard_size)  # what save_pretrained takes
    except ValueError:
        raise ExportError(f"--max-shard-size {max_shard_size!r}: expected a size such as 2GB or 500MiB") from None
    run, target = run_dir.resolve(), out.resolve()
    if target == run or run.is_relative_to(target):
        raise ExportError(f"--out {out} holds the run {run_dir}: export to a folder of its own")
    from hosfl_dist.runfolder.folder import run_in_the_way

    other = run_in_the_way(out)  # with or without --force: an export never replaces a run's files
    if other is not None:
        where = "holds" if other.is_relative_to(target) else "is inside"
        raise ExportError(f"--out {out} {where} the run folder {other}: export to a folder of its own")
    _check_out(out, force)
    if copy_base and fmt not in (None, "peft"):
        raise ExportError(f"--copy-base is for --format peft (a {fmt} export holds its weights already)")
    from hosfl_dist.runtime.record.progress import Steps

    step = Steps()
    tmp = _scratch(out)
    try:
        from hosfl_dist.runfolder.signing import check_outside, load_key

        key = load_key()
        check_outside(key, tmp)
        with step(f"restoring checkpoint {checkpoint} of {run_dir} ({_restoring(run_dir)})"):
            restored = restore(run_dir, checkpoint, allow_unsigned=allow_unsigned)
        lm = restored.cfg.model.name == "hf"
        fmt = fmt or ("merged" if lm else "state_dict")
        if lm and fmt == "state_dict":
            raise ExportError("--format state_dict is for vision models; a language model exports as merged or peft")
        if not lm and fmt != "state_dict":
            raise ExportError(f"--format {fmt}: a {restored.cfg.model.name} (vision) model exports as state_dict")
        from hosfl_dist.export.card import write_card, write_record

        if copy_base and fmt != "peft":
            raise ExportError(f"--copy-base is for --format peft (a {fmt} export holds its weights already)")
        if fmt == "merged":
            from hosfl_dist.export.hf import write_merged

            written = write_merged(restored, tmp, max_shard_size, step)
        elif fmt == "peft":
            from hosfl_dist.export.hf import write_peft

            written = write_peft(restored, tmp, max_shard_size, copy_base, step)
        else:
            from hosfl_dist.export.vision import write_vision

            with step("writing the state dict"):
                written = write_vision(restored, tmp)
        if lm:
            from hosfl_dist.models.sources import is_hub_id

            if is_hub_id(restored.cfg.model.source):
                written["base_hub"] = restored.cfg.model.source
        record = write_record(restored, tmp, written, command or _command(run_dir, out, checkpoint, fmt, copy_base))
        write_card(restored, tmp, record)
        from hosfl_dist.runfolder.exported import sign_export

        sign_export(tmp, key, restored.round)  # last: every file of the export, signed
        readable(tmp)  # safetensors writes 0600: colleagues on a shared file system read what the umask lets them
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _restoring(run_dir: Path) -> str:
    """What restoring the run's checkpoint does, for its step line: a language model reads its frozen base weights,
    de-quantising them only where the run read a GGUF file."""
    from hosfl_dist.export.restore import CONFIG
    from hosfl_dist.runtime.checks import load_run_config

    said = "verifying it, building the model"
    try:
        cfg = load_run_config(run_dir / CONFIG)
        if cfg.model.name != "hf":
            return said
        from hosfl_dist.models.sources import resolve

        gguf = resolve(cfg.model.source, cfg.model.gguf_file).gguf_file is not None
    except Exception:  # noqa: BLE001 - restore() says what is wrong with the run, in one line
        return said
    return f"{said}, reading the frozen base weights" + (": the GGUF base is de-quantised" if gguf else "")


def run_folder(path: Path) -> Path:
    """The run in ``path``: the folder itself, or the newest run of ``runs/<job.name>`` (its ``latest`` link)."""
    from hosfl_dist.export.restore import CONFIG

    if not (path / CONFIG).is_file() and (path / "latest" / CONFIG).is_file():
        return path / "latest"
    return path


def _command(run_dir: Path, out: Path, checkpoint: str, fmt: str, copy_base: bool = False) -> str:
    return shlex.join(["python", "-m", "hosfl_dist.export", str(run_dir), "--checkpoint", checkpoint, "--out",
                       str(out), "--format", fmt, *(["--copy-base"] if copy_base else [])])  # fmt: skip


def _check_out(out: Path, force: bool) -> None:
    from hosfl_dist.safe_files import check_output_folder

    if out.is_symlink():  # the rename would replace the link, not fill what it points at
        raise ExportError(f"--out {out} is a symlink: name the folder itself")
    check_output_folder(out, "--out", in_export=False, error=ExportError)  # not a file, device, FIFO; not in an export
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} already holds files (--force replaces them once the new export is complete)")


def _scratch(out: Path) -> Path:
    """A fresh hidden folder beside ``out`` (on its file system, so the final rename is atomic); the ones an export
    killed with SIGKILL left there (their process is gone) are removed first."""
    parent = out.parent
    for stale in parent.glob(f".{out.name}.partial-*") if parent.is_dir() else ():
        pid = stale.name.removeprefix(f".{out.name}.partial-").split("-")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name}.partial-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write in {parent} ({exc.strerror or exc})") from None
    return tmp


def _commit(tmp: Path, out: Path) -> None:
    """Put the complete export in its place: an empty (or --force'd) ``out`` is replaced by ``tmp``."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        else:
            out.rmdir()
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


EXAMPLES = """\
examples:
  python -m hosfl_dist.export runs/quickstart/latest --out runs/exports/quickstart   # vision: state dict + load_vision
  python -m hosfl_dist.export runs/quick_lm/latest --out runs/exports/quick_lm       # LM: a Hugging Face folder
  python -m hosfl_dist.export runs/quick_lm/latest --format peft --out runs/exports/quick_lm_peft   # a PEFT adapter
  python -m hosfl_dist.export runs/quick_lm/latest --checkpoint round-100 --out runs/exports/r100   # another checkpoint
  python -m hosfl_dist.export runs/quick_lm/latest --out runs/exports/quick_lm --force   # replace an earlier export
"""
"""What ``--help`` ends with (tests/test_cli.py parses each command)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hosfl_dist.export",
        description="Export a run's fine-tuned model: a Hugging Face folder with LoRA merged (merged), one PEFT "
        "adapter of the unsplit model (peft), or a vision model's state dict, with a model card.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder (runs/<name>/latest, job.out_dir)")
    p.add_argument("--checkpoint", default="latest", metavar="latest|round-N",
                   help="which checkpoint (default: the newest; it is verified first)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the folder to write (new or empty)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default=None,
                   help="merged (LM default): config.json, safetensors, tokenizer, for AutoModelForCausalLM; peft: "
                   "adapter_config.json + adapter_model.safetensors for PeftModel.from_pretrained, naming its base by "
                   "its source (a hub id, a local folder, or for GGUF/package/tiny bases one folder written once under "
                   "$HOSFL_CACHE/bases); state_dict: vision models")  # fmt: skip
    p.add_argument("--copy-base", action="store_true",
                   help="peft: write the base model into DIR/base and name it by that relative path (the folder then "
                   "holds everything it needs, e.g. to carry to another machine)")  # fmt: skip
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD,
                   help=f"safetensors shard size of LM weights (default {DEFAULT_SHARD})")  # fmt: skip
    p.add_argument("--force", action="store_true", help="replace the files in --out once the new export is complete")
    p.add_argument("--allow-unsigned", action="store_true", help="export a checkpoint whose manifest carries no "
                   "signature, if you trust whoever could write the run's folder; a signature mismatch is refused "
                   "whatever this says")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hosfl_dist.logs import init_logging

    init_logging("export")
    # SIGTERM (a scheduler, `timeout`) unwinds like Ctrl-C: the half-written folder is removed, --out is untouched
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.perf_counter()
    command = shlex.join(["python", "-m", "hosfl_dist.export", *(sys.argv[1:] if argv is None else argv)])
    try:
        record = export(args.run_dir, args.out, args.checkpoint, args.fmt, args.max_shard_size, args.force, command,
                        args.allow_unsigned, args.copy_base)  # fmt: skip
    except KeyboardInterrupt:  # the half-written folder is gone (export's cleanup), the run was only read
        print(f"interrupted: the export of {args.run_dir} to {args.out} stopped by Ctrl-C; --out is as it was and the "
              "run untouched: run the same command again", file=sys.stderr)  # fmt: skip
        return 130
    except Exception as exc:  # noqa: BLE001 - bad input and refused writes in one line; anything else its traceback
        failure = write_failure(exc, args.out)  # torch's and safetensors' wrapping of a full disk too
        if failure is not None:
            print(f"error: {failure} (--out is as it was; the run untouched)", file=sys.stderr)
            return 2
        if not isinstance(exc, (HosflError, OSError)):
            raise
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
        print(f"error: {message}{where}", file=sys.stderr)
        return 2
    metrics = record.get("metrics") or {}
    score = f", eval_accuracy {metrics['eval_accuracy']:.4f} in the run" if metrics.get("eval_accuracy") else ""
    print(f"exported round {record['round']} ({record['processed_samples']:,} samples{score}) of {args.run_dir} as "
          f"{record['format']} to {args.out}: {_size(args.out) / 2**20:.1f} MiB in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return 0
