"""How long opening and loading a GGUF model takes on this machine (CPU; no GPU needed).

    python -m benchmarks.gguf_load [--model PATH.gguf] [--reps 3] [--out DIR]

Times, each the median of ``--reps`` runs in this process: opening the file with
`models.gguf_file.GGUFFile` (what `load_model` uses) and with gguf-py's ``GGUFReader`` plus its
metadata contents (what it used before), and the whole ``sqjax.load_model``. Default model: the
embedded SmolLM2-135M. Writes ``gguf_load.json`` and ``gguf_load.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def _median_s(fn, reps: int) -> float:
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu_gguf_load")
    args = ap.parse_args(argv)

    import gguf

    import sqjax
    from benchmarks._meta import metadata, write_json
    from models import embedded_gguf_path
    from models.gguf_file import GGUFFile
    from sqjax.index_io import write_text_atomic

    path = Path(args.model) if args.model else embedded_gguf_path()

    def gguf_py():
        reader = gguf.GGUFReader(str(path))
        return {k: f.contents() for k, f in reader.fields.items()}

    rows = {
        "open: models.gguf_file.GGUFFile": _median_s(lambda: GGUFFile(path), args.reps),
        "open: gguf.GGUFReader + metadata contents": _median_s(gguf_py, args.reps),
        "sqjax.load_model (open, dequantize, build the model)": _median_s(lambda: sqjax.load_model(path), args.reps),
    }
    f = GGUFFile(path)
    payload = {**metadata(), "model": path.name, "file_bytes": path.stat().st_size, "reps": args.reps,
               "n_metadata_keys": len(f.metadata), "n_tensors": len(f.tensors), "median_s": rows}
    lines = [f"# GGUF load times, {path.name} ({payload['device']}, commit {payload['git_commit'][:7]})", "",
             f"Median of {args.reps} runs in one process; {len(f.metadata)} metadata keys, {len(f.tensors)} tensors.", "",
             "| step | median s |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in rows.items()]
    md = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gguf_load.json", payload)
    write_text_atomic(out / "gguf_load.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
