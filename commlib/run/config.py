"""The runner's configuration: command line first, then the environment, then defaults."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("commlib", "gloo")
DEFAULT_ALGORITHM = "gradient_allreduce"


@dataclass
class Config:
    """What ``python -m commlib`` was asked for.

    ``algorithm``/``algorithm_config``: the algorithm a ``DistributedDataParallel`` built
    without ``algorithm=`` gets (``COMMLIB_ALGORITHM``, ``COMMLIB_ALGORITHM_CONFIG``);
    ``backend``: what ``init_process_group()`` without a backend uses (``COMMLIB_BACKEND``);
    ``sync_points``: whether relaxed replicas are averaged at the automatic sync points
    (``COMMLIB_SYNC_POINTS=0`` turns them off); ``verbose``: report each sync point with the
    replica's checksum on stderr (``COMMLIB_RUN_VERBOSE=1``)."""

    algorithm: str = DEFAULT_ALGORITHM
    algorithm_config: dict[str, Any] = field(default_factory=dict)
    backend: str = "commlib"
    sync_points: bool = True
    verbose: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Config:
        env = os.environ if environ is None else environ
        return cls(algorithm=env.get("COMMLIB_ALGORITHM") or DEFAULT_ALGORITHM,
                   algorithm_config=parse_algorithm_config(
                       env.get("COMMLIB_ALGORITHM_CONFIG") or "{}", "COMMLIB_ALGORITHM_CONFIG"),
                   backend=check_backend(env.get("COMMLIB_BACKEND") or "commlib",
                                         "COMMLIB_BACKEND"),
                   sync_points=_flag(env.get("COMMLIB_SYNC_POINTS"), True),
                   verbose=_flag(env.get("COMMLIB_RUN_VERBOSE"), False))

    def export(self, environ: Any = None) -> None:
        """Write the configuration into the environment (child processes, and integrations
        such as the Lightning strategy, read it there)."""
        env = os.environ if environ is None else environ
        env["COMMLIB_ALGORITHM"] = self.algorithm
        env["COMMLIB_ALGORITHM_CONFIG"] = json.dumps(self.algorithm_config)
        env["COMMLIB_BACKEND"] = self.backend
        env["COMMLIB_SYNC_POINTS"] = "1" if self.sync_points else "0"
        env["COMMLIB_RUN_VERBOSE"] = "1" if self.verbose else "0"


def parse_algorithm_config(text: str, where: str = "--algorithm-config") -> dict[str, Any]:
    """A JSON object of the algorithm's keyword arguments (``ValueError`` naming ``where``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object of keyword arguments, e.g. "
                         f"'{{\"sync_every\": 4}}', got {text!r}")
    return value


def check_backend(name: str, where: str = "--backend") -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def _flag(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")
