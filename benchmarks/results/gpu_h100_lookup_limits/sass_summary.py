"""Per-kernel instruction mix, stall reasons and hottest SASS lines of an ncu source export (``ncu --import REP --page
source --csv --print-source sass``; ``run_ncu.sh`` writes it as sass.csv, kept here gzipped).

    python benchmarks/results/gpu_h100_lookup_limits/sass_summary.py ncu_506bc7f/sass.csv.gz > ncu_506bc7f/sass_summary.txt
"""
import collections
import csv
import gzip
import io
import sys


def kernels(path):
  text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
  out, cur = [], None
  for r in csv.reader(io.StringIO(text)):
    if r and r[0] == "Kernel Name":
      cur = {"name": r[1], "rows": []}
      out.append(cur)
    elif r and r[0] == "Address" and cur is not None:
      cur["hdr"] = {n: i for i, n in enumerate(r)}
    elif cur is not None and r:
      cur["rows"].append(r)
  return out


def num(r, i):
  try:
    return float(r[i] or 0)
  except (ValueError, IndexError):
    return 0.0


def main(path, top_ops=12, top_lines=6):
  for k in kernels(path):
    h = k["hdr"]
    ex_i, smp_i, src_i = h["Instructions Executed"], h["Warp Stall Sampling (All Samples)"], h["Source"]
    stall_cols = [c for c in h if c.startswith("stall_") and "Not Issued" not in c]
    ops, stalls = collections.Counter(), collections.Counter()
    for r in k["rows"]:
      words = r[src_i].split()
      op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?").split(".")[0]
      ops[op] += num(r, ex_i)
      for c in stall_cols:
        stalls[c[6:]] += num(r, h[c])
    total, samples = sum(ops.values()), sum(num(r, smp_i) for r in k["rows"])
    print(f"== {k['name']}: {total:.4g} warp instructions, {samples:.0f} stall samples")
    print("   mix: " + ", ".join(f"{op} {n / total:.1%}" for op, n in ops.most_common(top_ops)))
    st = sum(stalls.values()) or 1
    print("   stalls: " + ", ".join(f"{c} {v / st:.1%}" for c, v in stalls.most_common(8)))
    for r in sorted(k["rows"], key=lambda r: -num(r, smp_i))[:top_lines]:
      print(f"   {num(r, smp_i) / samples:6.1%}  {r[src_i].strip()}")


if __name__ == "__main__":
  main(sys.argv[1])
