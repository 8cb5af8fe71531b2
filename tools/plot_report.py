#!/usr/bin/env python3
"""Draws the plots of an `attnres compare` report from RUN_DIR/results.json.

Usage: python3 tools/plot_report.py RUN_DIR [OUT_DIR]
(The attnres binary embeds this script and runs it for `attnres compare` / `attnres report`, with
OUT_DIR a private directory it then moves the plots from.)
Writes val_loss.png, output_rms.png, grad_norm.png and depth_weights_<group>.png into OUT_DIR
(default RUN_DIR).
Needs only matplotlib (Debian: python3-matplotlib).
"""
import json
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def safe(name):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def scaling_plot(run_dir, out_dir):
    """`attnres scale`: validation loss against training FLOPs per mode, log-log, with the fits."""
    with open(os.path.join(run_dir, "scaling.json")) as f:
        s = json.load(f)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for mode, m in s["modes"].items():
        pts = m.get("points", [])
        if not pts:
            continue
        C = [p["flops"] for p in pts]
        L = [p["val_loss"] for p in pts]
        line, = ax.plot(C, L, marker="o", linestyle="none", label=mode)
        fit = m.get("fit", {})
        if fit.get("alpha") is not None and len(C) > 1:
            xs = [min(C) * (max(C) / min(C)) ** (i / 49.0) for i in range(50)]
            ax.plot(xs, [fit["A"] * x ** (-fit["alpha"]) for x in xs], color=line.get_color(),
                    linewidth=1, label="%s: %.3g C^-%.4f" % (mode, fit["A"], fit["alpha"]))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Loss vs compute (one point per size)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"))
    plt.close(fig)
    print("scaling.png")


def main(run_dir, out_dir):
    if (os.path.exists(os.path.join(run_dir, "scaling.json"))
            and not os.path.exists(os.path.join(run_dir, "results.json"))):
        return scaling_plot(run_dir, out_dir)
    with open(os.path.join(run_dir, "results.json")) as f:
        res = json.load(f)
    groups = res["groups"]
    runs = res["runs"]
    by_group = {g["name"]: [r for r in runs if r["group"] == g["name"]] for g in groups}
    written = []

    # 1. Validation loss vs tokens and vs training wall time: mean over the seeds that
    # finished, shaded min..max. (Curves are [tokens, loss, seconds]; older files lack seconds.)
    def finished(rs):
        return [r for r in rs if r.get("status", "ok") == "ok" and r.get("curve")]

    longest = max([p[2] for r in runs for p in (r.get("curve") or [])
                   if len(p) > 2 and p[2] is not None] or [0])
    time_scale, time_unit = (60.0, "minutes") if longest > 120 else (1.0, "seconds")
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.0), dpi=100)
    for g in groups:
        rs = finished(by_group[g["name"]])
        if not rs:
            continue
        n = min(len(r["curve"]) for r in rs)
        vals = [[r["curve"][i][1] for r in rs] for i in range(n)]
        m = [mean(v) for v in vals]
        for k, ax in enumerate(axes):
            if k == 0:
                xs = [rs[0]["curve"][i][0] for i in range(n)]
            else:
                if any(len(r["curve"][i]) < 3 or r["curve"][i][2] is None
                       for r in rs for i in range(n)):
                    continue
                xs = [mean([r["curve"][i][2] for r in rs]) / time_scale for i in range(n)]
            line, = ax.plot(xs, m, marker="o", markersize=3, label=g["name"])
            if len(rs) > 1:
                ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals],
                                color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("training wall time (%s, mean over seeds)" % time_unit)
    for ax in axes:
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes[0].set_title("Validation loss vs tokens\n(mean over seeds, band = min..max)", fontsize=10)
    axes[1].set_title("Validation loss vs wall time\n(%s)" % res.get("hardware", {}).get("cpu", ""),
                      fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "val_loss.png"))
    plt.close(fig)
    written.append("val_loss.png")

    # 2./3. Per-sublayer output RMS and gradient norm vs depth (final diagnostics).
    for key, fname, ylabel, title in [
        ("output_rms", "output_rms.png", "RMS of sublayer output", "Sublayer output magnitude vs depth"),
        ("grad_norm", "grad_norm.png", "gradient norm of sublayer weights", "Gradient norm vs depth"),
    ]:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for g in groups:
            rs = [r for r in by_group[g["name"]] if r.get("status", "ok") == "ok"
                  and r.get("diagnostics") and r["diagnostics"].get(key)]
            if not rs:
                continue
            L = len(rs[0]["diagnostics"][key])
            ys = [mean([r["diagnostics"][key][l] for r in rs]) for l in range(L)]
            ax.plot(range(L), ys, marker="o", markersize=3, label=g["name"])
        ax.set_xlabel("sublayer (0 = first attention; even = attention, odd = MLP)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(title + "\n(end of training, mean over seeds)", fontsize=10)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname))
        plt.close(fig)
        written.append(fname)

    # 4. Depth-attention weights heatmap per mode that has them (mean over seeds).
    for g in groups:
        rs = [r for r in by_group[g["name"]] if r.get("status", "ok") == "ok"
              and r.get("diagnostics") and r["diagnostics"].get("depth_weights")]
        if not rs:
            continue
        dw = rs[0]["diagnostics"]["depth_weights"]
        rows, cols = dw["rows"], dw["cols"]
        W = [[mean([r["diagnostics"]["depth_weights"]["w"][i][j] for r in rs])
              for j in range(len(cols))] for i in range(len(rows))]
        fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(cols), 1.0 + 0.42 * len(rows)), dpi=100)
        masked = [[(x if math.isfinite(x) else float("nan")) for x in row] for row in W]
        im = ax.imshow(masked, cmap="viridis", vmin=0.0, aspect="auto")
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels(cols, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows, fontsize=7)
        for i, row in enumerate(W):
            for j, x in enumerate(row):
                if math.isfinite(x):
                    ax.text(j, i, "%.0f" % (100 * x), ha="center", va="center", fontsize=6,
                            color="white" if x < 0.5 else "black")
        ax.set_xlabel("source")
        ax.set_ylabel("reader")
        ax.set_title("Depth weights, %s (%%)" % g["name"], fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.04)
        fig.tight_layout()
        fname = "depth_weights_%s.png" % safe(g["name"])
        fig.savefig(os.path.join(out_dir, fname))
        plt.close(fig)
        written.append(fname)
    print(" ".join(written))


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[-1])
