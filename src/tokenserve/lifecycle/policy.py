"""Which versions on disk should be served: TF Serving's `ServableVersionPolicy`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tokenserve.errors import ConfigError


@dataclass(frozen=True)
class VersionPolicy:
    """`latest {num_versions}`, `all {}` or `specific {versions}`.

    Example:
        >>> VersionPolicy.latest(2).select([1, 2, 3])
        {2, 3}
    """

    kind: Literal["latest", "all", "specific"] = "latest"
    num_versions: int = 1
    """For `latest`: how many of the highest versions to serve."""
    versions: frozenset[int] = field(default_factory=frozenset)
    """For `specific`: exactly these versions."""

    def __post_init__(self):
        if self.kind not in ("latest", "all", "specific"):
            raise ConfigError(f"unknown version policy {self.kind!r}")
        if self.kind == "latest" and self.num_versions < 1:
            raise ConfigError(f"latest policy needs num_versions >= 1, got {self.num_versions}")
        if self.kind == "specific" and not self.versions:
            raise ConfigError("specific version policy needs at least one version")

    @classmethod
    def latest(cls, num_versions: int = 1) -> VersionPolicy:
        return cls("latest", num_versions=num_versions)

    @classmethod
    def all(cls) -> VersionPolicy:
        return cls("all")

    @classmethod
    def specific(cls, versions) -> VersionPolicy:
        return cls("specific", versions=frozenset(int(v) for v in versions))

    def select(self, on_disk: list[int]) -> set[int]:
        """The aspired versions among the version numbers found on disk."""
        if self.kind == "all":
            return set(on_disk)
        if self.kind == "specific":
            return self.versions & set(on_disk)
        return set(sorted(on_disk)[-self.num_versions:])
