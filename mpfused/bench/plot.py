"""bench.png: loss curves, step time (split into optimizer and the rest) and training-state memory."""
import os

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402


def _smooth(values, window):
    """Trailing mean over `window` steps (skipping non-finite points): readable, barely lagging."""
    smoothed = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        smoothed.append(sum(recent) / len(recent) if recent else float("nan"))
    return smoothed


def plot_results(results, out_dir):
    config = results["config"]
    ok = {name: r for name, r in results["recipes"].items() if r["status"] == "ok"}
    fig, (ax_loss, ax_time, ax_mem) = plt.subplots(1, 3, figsize=(16, 4.8))
    fig.suptitle(f"mpfused.bench: {config['size']} model ({config['n_params'] / 1e6:.2f}M params), "
                 f"{config['dtype']} autocast, {config['device_name']}")

    window = max(1, config["steps"] // 25)
    for name, r in ok.items():
        line, = ax_loss.plot(_smooth(r["losses"], window), label=name)
        ax_loss.plot([float("nan") if v is None else v for v in r["losses"]],
                     color=line.get_color(), alpha=0.15)
    ax_loss.set(title=f"training loss (mean of {window} steps; raw faint)", xlabel="step", ylabel="cross-entropy")
    ax_loss.legend()

    names = list(ok)
    optimizer_ms = [ok[n]["optimizer_time_ms"] or 0 for n in names]
    rest_ms = [(ok[n]["step_time_ms"] or 0) - o for n, o in zip(names, optimizer_ms)]
    ax_time.bar(names, rest_ms, label="forward + backward")
    ax_time.bar(names, optimizer_ms, bottom=rest_ms, label="scaler.step + update + zero_grad")
    ax_time.set(title="median step time", ylabel="ms")
    ax_time.set_ylim(0, 1.25 * max(rest + o for rest, o in zip(rest_ms, optimizer_ms)) if names else 1)
    ax_time.legend(loc="upper left", fontsize="small")

    parts = [("weights", "weights"), ("grads", "grads"), ("master", "master"),
             ("optimizer_state", "optimizer state"), ("scaler", "scaler")]
    bottom = [0.0] * len(names)
    for key, label in parts:
        values = [ok[n]["state_bytes_per_param"].get(key, 0) for n in names]
        ax_mem.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    if config["device"].startswith("cuda"):
        ax_peak = ax_mem.twinx()
        ax_peak.plot(names, [ok[n]["peak_memory_bytes"] / 2**20 for n in names], "ko",
                     label="CUDA peak (MiB, right)")
        ax_peak.set_ylabel("peak MiB")
        ax_peak.set_ylim(bottom=0)
        ax_peak.legend(loc="upper right")
    ax_mem.set(title="training state per parameter", ylabel="bytes / param")
    ax_mem.set_ylim(0, 1.35 * max(bottom, default=1))  # headroom for the legend
    ax_mem.legend(loc="upper left", fontsize="small", ncol=3)
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", rotation=20)

    fig.tight_layout()
    path = os.path.join(out_dir, "bench.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
