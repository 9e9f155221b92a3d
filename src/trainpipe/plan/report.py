"""The plan as tables: decisions with their rules, the memory breakdown, compute and cost."""

from __future__ import annotations

GIB = 1024**3


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def print_plan(plan: dict) -> None:
    from rich.table import Table

    from trainpipe import ui

    con = ui.console()
    m = plan["model"]
    if m:
        trainable = f"{m['trainable_params']:,} trainable ({100 * m['trainable_params'] / max(1, m['params']):.2f} %)" if m.get("trainable_params") is not None else "trainable: not sized"
        con.print(f"[bold]{m['id']}[/] ({m['source']}, {m['model_type']}): {m['params'] / 1e9:.3f}B parameters, {trainable}",
                  markup=True, highlight=False, soft_wrap=True)
        if m.get("note"):
            con.print(f"note: {m['note']}", markup=False, soft_wrap=True)
    for n in plan.get("notes") or ():
        con.print(f"note: {n}", markup=False, soft_wrap=True)
    with_source = any("source" in d for d in plan["decision"])
    t = Table(title="plan (what `trainpipe run` executes)" if with_source else "decisions")
    for c in ("choice", "value", *(("from",) if with_source else ()), "rule", "what to watch"):
        t.add_column(c, overflow="fold")
    for d in plan["decision"]:
        t.add_row(d["key"], str(d["value"]), *((d.get("source", ""),) if with_source else ()), d["rule"], d.get("watch", ""))
    con.print(t)
    pd = plan["memory"]["per_device"]
    if pd is None:
        pd = {}
    if pd:
        mt = Table(title="memory per device (GiB)")
        mt.add_column("piece")
        mt.add_column("GiB", justify="right")
        for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes"):
            mt.add_row(k.replace("_bytes", ""), _gib(pd[k]))
        if pd.get("cpu_offload_bytes"):
            mt.add_row("offloaded to CPU", _gib(pd["cpu_offload_bytes"]))
        con.print(mt)
    fits = plan["memory"]["fits"]
    if fits:
        con.print("fits: " + ", ".join(f"{g} {'yes' if ok else 'no'}" for g, ok in fits.items()), markup=False, soft_wrap=True)
    if plan.get("fits") is False:
        con.print(f"DOES NOT FIT: {plan.get('why_not')}", markup=False, soft_wrap=True)
    if plan.get("headline"):
        con.print(f"headline ({plan['headline']['objective']}): {plan['headline']['rule']}", markup=False, soft_wrap=True)
    r = plan["recommendation"]
    con.print(f"{'recommendation' if plan.get('fits', True) else 'closest plan (does not fit)'}: {r['method']} on {r['num_gpus']} x {r['gpu']} ({r['strategy']}{', offload ' + r['offload'] if r['offload'] != 'none' else ''}), "
              f"{r['precision']}, micro-batch {r['micro_batch']} x accumulation {r['gradient_accumulation']} x "
              f"{str(plan['parallel']['data']) + ' data-parallel replica(s)' if plan.get('parallel') else str(r['num_gpus']) + ' device(s)'} = effective batch {r['effective_batch']}, "
              f"gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, lr {r['learning_rate']:g}", markup=False, soft_wrap=True)
    c = plan.get("compute")
    if c:
        if c.get("tokens_known"):
            cost = plan["cost"]
            con.print(f"compute: {c['flops']:.3g} FLOPs for {c['tokens']:.3g} tokens at MFU {c['mfu_assumed']:.0%}: {c['hours']:.2f} h "
                      f"({c['gpu_hours']:.1f} GPU-h); cost on-demand ${cost['on_demand_usd']:,.2f}, spot ${cost['spot_usd']:,.2f} "
                      f"(checkpoint every {60 * cost['checkpoint_interval_hours']:.0f} min, {100 * cost['spot_waste_fraction']:.1f} % rework at "
                      f"{cost['preemptions_per_hour']:g} preemptions/h)", markup=False, soft_wrap=True)
        else:
            con.print(f"compute: {c['flops_per_token']:.3g} FLOPs per token; give --tokens N (or --examples N --avg-len L) for time and cost", markup=False, soft_wrap=True)
    if plan.get("ranking"):
        by_time = (plan.get("headline") or {}).get("objective") == "time"
        rt = Table(title="fastest setups that fit" if by_time else "cheapest setups that fit")
        for col in ("gpu", "n", "method", "strategy", "hours", "on-demand $", "spot $", "memory margin GiB"):
            rt.add_column(col)
        for row in plan["ranking"]:
            rt.add_row(row["gpu"], str(row["num_gpus"]), row["method"], row["strategy"], f"{row['hours']:.2f}", f"{row['on_demand_usd']:,.2f}", f"{row['spot_usd']:,.2f}", f"{row['memory_margin_gib']:.1f}")
        con.print(rt)
