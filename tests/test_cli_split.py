"""The `mesh` command as each side registers it (docs/design.md item 12, issue 17): the gateway's
subcommands in mesh/cli.py, the workers' in workers/cli.py, the demo supervisor in its own
module, put together through the `atomesh.commands` entry points; every subcommand's help says
each option and shows an example; CLI failures are one line."""

from __future__ import annotations

import socket
import subprocess
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from mesh.cli import parser
from tests.conftest import MESH_BIN

ROOT = Path(__file__).resolve().parent.parent
SIDES = {"serve": "mesh.cli", "workers": "mesh.cli", "bench": "mesh.cli", "etcd-auth": "mesh.cli", "prefill": "workers.cli",
         "decode": "workers.cli", "stage": "workers.cli", "register": "workers.cli", "mock-fleet": "workers.cli",
         "demo": "demo.supervisor"}


def _subparsers() -> dict[str, object]:
    p = parser()
    act = next(a for a in p._actions if a.dest == "cmd")
    return dict(act.choices)  # type: ignore[attr-defined]


def test_each_side_registers_its_own_subcommands_through_entry_points():
    eps = {ep.name: ep.value for ep in entry_points(group="atomesh.commands")}
    assert eps == {"gateway": "mesh.cli:add_commands", "workers": "workers.cli:add_commands",
                   "demo": "demo.supervisor:add_commands"}
    subs = _subparsers()
    assert set(subs) == set(SIDES)
    for name, sp in subs.items():
        assert sp.get_default("func").__module__ == SIDES[name], name  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SIDES))
def test_every_subcommand_helps_with_each_option_and_an_example(name):
    sp = _subparsers()[name]
    text = sp.format_help()  # type: ignore[attr-defined]
    assert f"example:\n  mesh {name} " in text or f"example:\n  ATOMESH_PIPELINE_SECRET=... mesh {name} " in text, text
    for act in sp._actions:  # type: ignore[attr-defined]
        if act.option_strings and act.dest != "help":
            assert act.help, f"mesh {name} {act.option_strings[0]} has no help"
            if act.choices:
                assert all(str(c) in text for c in act.choices)


def test_register_knows_the_kv_backends_and_says_so_in_one_line():
    r = subprocess.run([MESH_BIN, "register", "--etcd", "http://127.0.0.1:1", "--role", "decode", "--url",
                        "http://127.0.0.1:9", "--model", "m", "--kv-backend", "rdma-magic"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--kv-backend" in r.stderr and "'nixl'" in r.stderr and "'mooncake'" in r.stderr


def test_register_with_etcd_out_of_reach_is_one_line_and_non_zero():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    r = subprocess.run([MESH_BIN, "register", "--etcd", f"http://127.0.0.1:{dead}", "--role", "decode", "--url",
                        "http://127.0.0.1:9", "--model", "m"], capture_output=True, text=True, timeout=90)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("mesh: error: etcd unreachable at") and len(r.stderr.strip().splitlines()) == 1
