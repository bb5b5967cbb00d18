"""The dashboard image's command: ``fedatoms-dashboard serve …`` = ``fedatoms dashboard serve …``.

It mounts only the dashboard's parser: the full ``fedatoms`` parser imports the simulator (torch).

The image carries no torch. ``dashboard_api.settings`` imports only ``split_listen`` from
``aggregator_service.config``, but that module imports the strategies, which import torch. Until
the dashboard imports it from a torch-free module, this entry point registers a stand-in
``aggregator_service.config`` that holds just that function, compiled from config.py's own source
(so it cannot drift). Where torch is installed nothing is replaced.
"""

import argparse
import ast
import importlib.util
import sys
import types


def _torch_free_config() -> None:
    if "aggregator_service.config" in sys.modules:
        return
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        return
    spec = importlib.util.find_spec("aggregator_service.config")
    tree = ast.parse(spec.loader.get_source(spec.name))
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "split_listen"]
    module = types.ModuleType(spec.name)
    module.__file__ = spec.origin
    exec(compile(ast.Module(body=body, type_ignores=[]), spec.origin, "exec"), module.__dict__)
    sys.modules[spec.name] = module


def main() -> int:
    _torch_free_config()
    from dashboard_api.cli import add_parser

    parser = argparse.ArgumentParser(prog="fedatoms-dashboard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboard", *sys.argv[1:]])
    try:
        status = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"fedatoms-dashboard: error: {exc}\n")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
