#!/usr/bin/python3
"""Plots bench/coordination.cc's JSON (--json FILE) against the member count:
rendezvous calls per second, the coordinator's poll time, and the times from a
member's loss to the new round and to every member having seen it, one line
per store.

    bench/plot_coordination.py coordination.json [--out docs/coordination.png]
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default="docs/coordination.png")
    args = ap.parse_args()
    rows = json.load(open(args.json))
    # One line per store and heartbeat timeout (older files have no timeout: 0.4 s).
    def series(r):
        hb = r.get("heartbeat_timeout_s", 0.4)
        return r["store"] + ("" if hb == 0.4 else f" (heartbeat timeout {hb:g} s)")
    stores = sorted({series(r) for r in rows})
    panels = [("calls_per_s", "rendezvous calls / s (all clients)", 1),
              ("poll_ms", "coordinator poll (ms, median)", 1),
              ("loss_to_round_s", "member lost -> new round written (s)", 1),
              ("round_to_all_s", "round written -> every member saw it (s)", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title, scale) in zip(axes, panels):
        for s in stores:
            pts = sorted((r["members"], r[key]) for r in rows if series(r) == s and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], marker="o", label=s)
        ax.set_xscale("log")
        ax.set_xlabel("members")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
