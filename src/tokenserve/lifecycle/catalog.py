"""Every servable id a client may use, for listings such as the OpenAI `/v1/models`.

Ids follow the forms TF Serving addresses versions by: `name` (the newest AVAILABLE
version), `name:version` and `name@label` (labels pointing at an AVAILABLE version only).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenserve.lifecycle.manager import ModelManager


@dataclass(frozen=True)
class ServableEntry:
    """One id and the version it reaches now."""

    id: str
    model_name: str
    version: int
    label: str | None
    loaded_at: float | None
    """Unix time the version became AVAILABLE."""


def servable_entries(manager: ModelManager) -> list[ServableEntry]:
    """Names first, then `name:version` (newest first), then `name@label`, per model.

    Example:
        >>> [e.id for e in servable_entries(manager)]
        ['builtin', 'builtin:2', 'builtin:1', 'builtin@stable']
    """
    entries = []
    for name in manager.model_names():
        available = manager.available_versions(name)
        if not available:
            continue
        by_number = {version.version: version for version in available}
        newest = available[0]
        entries.append(ServableEntry(name, name, newest.version, None, newest.loaded_at))
        entries += [ServableEntry(f"{name}:{v.version}", name, v.version, None, v.loaded_at)
                    for v in available]
        for label, number in sorted(manager.labels(name).items()):
            if number in by_number:
                entries.append(ServableEntry(f"{name}@{label}", name, number, label,
                                             by_number[number].loaded_at))
    return entries
