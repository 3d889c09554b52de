"""Named specs of one kind — methods, tasks, models, model sources — the package's own and those plug-ins add
(``job.plugins``): one place that refuses a name taken twice and names the choices when one is unknown."""

from __future__ import annotations

from typing import TypeVar

from hosfl_dist.errors import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(dict[str, T]):
    """A dict of specs by name (``kind``: what they are, for errors; ``key``: the config key that names one)."""

    def __init__(self, kind: str, key: str) -> None:
        super().__init__()
        self.kind, self.key = kind, key

    def add(self, name: str, spec: T) -> T:
        """Register ``spec`` under ``name``; the same spec again is a no-op, another one a ValueError."""
        if name in self and self[name] != spec:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self[name] = spec
        return spec

    def names(self) -> list[str]:
        return sorted(self)

    def get_or_refuse(self, name: str) -> T:
        """The spec of ``name``; a ConfigError naming the key, every registered name and the one closest to ``name``
        (did you mean) otherwise."""
        if name not in self:
            hint = did_you_mean(name, self.names(), quote=True)
            raise ConfigError(f"invalid value for {self.key}: {name!r} (choose one of {self.names()}{hint})")
        return self[name]
