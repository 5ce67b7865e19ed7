"""What the run history keeps of the preflight's estimate and the run summary says of it and of
the engines' fallbacks.

Holds ``FALLBACK`` (the prefix of the engines' notes of a fallback), ``estimate_record`` (the
estimate as the history keeps it), ``record_peak`` (each actor's measured peak beside it),
``add_fallback`` (a fallback said once, however many actors noted it) and ``summary_lines``.
"""

from __future__ import annotations

from typing import Any

from classgrad.service.driver_runtime.footprint import mb

FALLBACK = "fallback: "  # the engines' notes of a fallback start so (partitioned.engine.FALLBACK)


def estimate_record(footprint: dict | None) -> dict[str, Any]:
    """The estimate as the run history keeps it: the totals and each part's bytes."""
    if not footprint:
        return {}
    keep = ("actor_bytes", "device_bytes", "driver_bytes", "store_bytes", "store_disk_bytes", "device")
    record = {k: footprint[k] for k in keep if k in footprint}
    record["actor_parts"] = {p["name"]: p["bytes"] for p in footprint.get("actor", [])}
    return record


def record_peak(memory: dict[str, Any], report: dict[str, Any]) -> None:
    """Keep an actor's measured peak (its shard report's ``peak_rss_bytes``) beside the estimate."""
    peak = report.get("peak_rss_bytes")
    if peak is None:
        return
    actor = f"{report.get('host', '?')}:{report.get('pid', '?')}"
    peaks = memory.setdefault("peak_rss_per_actor", {})
    peaks[actor] = max(int(peak), peaks.get(actor, 0))
    if "peak_device_bytes" in report:
        device = memory.setdefault("peak_device_per_actor", {})
        device[actor] = max(int(report["peak_device_bytes"]), device.get(actor, 0))


def add_fallback(fallbacks: list[str], note: str) -> bool:
    """Whether ``note`` says a fallback; if so it joins ``fallbacks`` unless one already says the
    same (actors give up the same path for the same reason, on packs of other sizes)."""
    if not note.startswith(FALLBACK):
        return False
    said = note.split(";")[0]
    if not any(f.split(";")[0] == said for f in fallbacks):
        fallbacks.append(note)
    return True


def summary_lines(fallbacks: list[str], preflight: list[str], memory: dict[str, Any]) -> list[str]:
    """The run summary's lines of fallbacks, preflight notes and memory (estimate beside measured)."""
    lines = [f"  fallback    {note[len(FALLBACK) :]}" for note in fallbacks]
    lines += [f"  preflight   {note.removeprefix('preflight: ')}" for note in preflight]
    estimate = memory.get("estimate") or {}
    peaks = memory.get("peak_rss_per_actor") or {}
    if estimate or peaks:
        text = f"estimate ~{mb(estimate['actor_bytes'])} per actor" if "actor_bytes" in estimate else "no estimate"
        if peaks:
            text += f"; measured peak RSS {mb(max(peaks.values()))} (highest of {len(peaks)} actors)"
        lines.append(f"  memory      {text}")
    return lines
