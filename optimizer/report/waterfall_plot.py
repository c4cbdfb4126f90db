"""The waterfall as a PNG (report.md links it; `optimize build` and `report -o` write it).

    (directory / WATERFALL_PNG).write_bytes(waterfall_png(report))    # the same bytes for the same report
"""

from __future__ import annotations

import io

WATERFALL_PNG = "economics_waterfall.png"


def waterfall_png(report: dict) -> bytes:
    """The compounding factors per GPU: $/Mtok after each applied step, each bar from the step before."""
    import matplotlib  # lazy: matplotlib is slow to import; only a build or `report -o` draws the PNG

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    gpus = report["gpus"]
    fig, axes = plt.subplots(1, len(gpus), figsize=(4.6 * len(gpus), 4.2), squeeze=False)
    for ax, g in zip(axes[0], gpus.values(), strict=True):
        rows = [r for r in g["waterfall"] if r["applied"]]
        labels, prev = [], None
        for i, r in enumerate(rows):
            labels.append(r["label"].replace(" (KV structure)", "").replace("KV-cache quantization", "KV quant"))
            cost = r["usd_per_mtok"]
            if cost is None:
                ax.text(i, 0.03, "does not fit", rotation=90, ha="center", va="bottom", fontsize=7,
                        transform=ax.get_xaxis_transform())
            elif prev is None:
                ax.bar(i, cost, color="#777777")
                ax.text(i, cost, f"${cost:.3g}", ha="center", va="bottom", fontsize=7)
            else:
                low, high = min(prev, cost), max(prev, cost)
                ax.bar(i, high - low, bottom=low, color="#2a9d8f" if cost <= prev else "#e76f51")
                ax.text(i, high, f"x{prev / cost:.3g}", ha="center", va="bottom", fontsize=7)
            prev = cost
        if rows and rows[-1]["usd_per_mtok"] is not None:
            final = rows[-1]["usd_per_mtok"]
            ax.bar(len(rows), final, color="#264653")
            total = f"x{g['total_factor']:.3g}" if g["total_factor"] else ""
            ax.text(len(rows), final, f"${final:.3g}\n{total}", ha="center", va="bottom", fontsize=7)
            labels.append("served")
        ax.set_xlim(-0.6, len(labels) - 0.4)  # a step that does not fit has no bar to widen the axis
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
        costs = [r["usd_per_mtok"] for r in rows if r["usd_per_mtok"] is not None]
        if costs:
            ax.set_ylim(0, 1.2 * max(costs))  # room for the labels above the bars
        ax.set_ylabel("$ per million decoded tokens")
        ax.set_title(f"{g['device']} at ${g['price_per_hour']:.2f}/h", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{report['model_type']}: compounding factors at the max batch, context {report['decode_context']}",
                 fontsize=9)
    fig.subplots_adjust(left=0.3 / len(gpus), right=0.99, bottom=0.24, top=0.86, wspace=0.3)  # tight_layout: 2x slower
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata={"Software": None})  # no version stamp: reproducible bytes
    plt.close(fig)
    return buffer.getvalue()
