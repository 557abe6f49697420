#!/usr/bin/python3
"""Plots bench/coordination.cc's JSON (--json FILE) against the member count,
one line per store, and projects it to 100,000 members.

Panels: loss -> new round written; join (all registered, one round); the
steady-state CPU of the coordinator and of the store (share of one core);
the coordinator's poll time. The projection (dashed) fits each CPU share
and the poll time as a + b * members over the measured points (least
squares) and draws it to 100,000 members; the printed table says at how
many members each one reaches a whole core (or, for the poll, the 20 ms
poll interval), i.e. what saturates first.

    bench/plot_coordination.py coordination.json [--out docs/coordination.png]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOP = 100_000


def fit(pts):
    """a + b x by least squares over (x, y) points."""
    n = len(pts)
    if n < 2:
        return None
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return my - b * mx, b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default="docs/coordination.png")
    args = ap.parse_args()
    rows = json.load(open(args.json))
    stores = sorted({r["store"] for r in rows})
    # (key, title, scale, saturation level for the projection or None)
    panels = [("loss_to_round_s", "member lost -> round written (s)", 1, None),
              ("join_s", "join: all registered, one round (s)", 1, None),
              ("coordinator_cpu", "coordinator CPU (% of a core)", 100, 100),
              ("store_cpu", "store CPU (% of a core)", 100, 100),
              ("poll_ms", "coordinator poll (ms, median)", 1, 20)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6))
    saturation = []
    for ax, (key, title, scale, limit) in zip(axes, panels):
        for i, s in enumerate(stores):
            pts = sorted((r["members"], r[key] * scale) for r in rows
                         if r["store"] == s and r.get(key) is not None)
            if not pts:
                continue
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)[0]
            if limit is None:
                continue
            f = fit(pts)
            if f is None:
                continue
            a, b = f
            xs = [pts[-1][0], TOP]
            ax.plot(xs, [a + b * x for x in xs], linestyle="--", color=line.get_color(), alpha=0.7)
            reach = (limit - a) / b if b > 0 else float("inf")
            saturation.append((reach, s, title, a + b * TOP))
        if limit is not None:
            ax.axhline(limit, color="grey", linewidth=0.8, linestyle=":")
            ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("members")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    print("projection (a + b x fitted to the measured points), what reaches its limit first:")
    for reach, s, title, at_top in sorted(saturation):
        where = f"{reach:,.0f} members" if reach != float("inf") else "never (no growth)"
        print(f"  {s:9s} {title:36s} limit at {where}; at {TOP:,}: {at_top:,.1f}")


if __name__ == "__main__":
    main()
