"""The printed results table and results.json."""
import json
import os


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _state_breakdown(per_param):
    """e.g. 'w2 g2 m4 s8' : bytes per parameter of weights, grads, master, optimizer state."""
    if not per_param:
        return "-"
    parts = [("w", "weights"), ("g", "grads"), ("m", "master"), ("s", "optimizer_state")]
    return " ".join(f"{short}{per_param.get(key, 0):.3g}" for short, key in parts)


def format_table(results):
    config, recipes = results["config"], results["recipes"]
    memory_header = "peak MiB" if config["device"].startswith("cuda") else "state MiB"
    header = (f"{'recipe':<17} {'step ms':>8} {'opt ms':>7} {memory_header:>9} {'B/param':>7}  "
              f"{'breakdown (w g m s)':<22} {'final loss':>10} {'gap %':>7} {'val loss':>8}")
    lines = [header, "-" * len(header)]
    notes = []
    for name, r in recipes.items():
        if r["status"] != "ok":
            lines.append(f"{name:<17} unavailable: {r['reason']}")
            continue
        peak = r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] is not None else None
        per_param = r["state_bytes_per_param"]
        lines.append(
            f"{name:<17} {_fmt(r['step_time_ms'], '8.2f')} {_fmt(r['optimizer_time_ms'], '7.2f')} "
            f"{_fmt(peak, '9.2f')} {_fmt(per_param.get('total'), '7.2f')}  "
            f"{_state_breakdown(per_param):<22} {_fmt(r['final_loss'], '10.4f')} "
            f"{_fmt(r['final_loss_gap_pct'], '+7.2f')} {_fmt(r['validation_loss'], '8.4f')}")
        notes.append(f"  {name}: {r['optimizer']}, {r['weights_dtype']} weights, "
                     f"GradScaler {'enabled' if r['scaler_enabled'] else 'disabled'}, "
                     f"{r['wall_seconds']} s wall incl. warm-up")
    footer = [
        "",
        f"step ms / opt ms: medians over {config['steps'] - config['warmup_steps']} timed steps "
        f"(after {config['warmup_steps']} warm-up); opt = scaler.step + scaler.update + zero_grad.",
        f"{memory_header}: " + ("torch.cuda.max_memory_allocated (includes activations)"
                                if config["device"].startswith("cuda") else
                                "bytes of weights + grads + optimizer state + scaler tensors")
        + "; B/param: that state per parameter, measured from the tensors.",
        f"final loss: mean of the last {config['final_loss_window']} steps; gap: vs native. "
        f"val loss: {config['dtype']} autocast on held-out text.",
        f"GradScaler: {config['grad_scaler']}.",
    ]
    return "\n".join(lines + footer + notes)


def write_json(results, out_dir):
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, allow_nan=False)
    return path
