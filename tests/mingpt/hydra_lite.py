"""The part of hydra-core's ``@hydra.main`` that minGPT-ddp's main.py uses, so the copy
runs without hydra-core/omegaconf: load ``<config_path>/<config_name>.yaml`` (relative to
the script), apply hydra's ``key.sub=value`` command-line overrides (values parsed as YAML),
and call the function with the configuration as nested dicts. (Not part of upstream.)"""
import functools
import os
import sys

import yaml


def main(version_base=None, config_path=".", config_name="config"):
    def decorate(fn):
        @functools.wraps(fn)
        def run():
            here = os.path.dirname(os.path.abspath(sys.modules[fn.__module__].__file__))
            with open(os.path.join(here, config_path, config_name + ".yaml")) as f:
                cfg = yaml.safe_load(f)
            for override in sys.argv[1:]:
                key, _, value = override.partition("=")
                *parents, leaf = key.split(".")
                node = cfg
                for part in parents:
                    node = node[part]
                node[leaf] = yaml.safe_load(value)
            cfg.pop("hydra", None)
            return fn(cfg)
        return run
    return decorate
