"""Pure parts of the manager's tiers: which ranks form nodes and keep whose replicas, and which
steps a survey of the nodes and the durable tier can restore."""

from __future__ import annotations

import pytest

from deepnvme.checkpoint.manager._nodes import Layout
from deepnvme.checkpoint.manager._tiers import Survey


def test_partners_are_on_the_next_node():
    layout = Layout(rank=1, nodes=((0, 1), (2, 3)))
    assert layout.world == 4 and layout.node == 0 and not layout.leader and layout.leaders == [0, 2]
    assert [layout.partner(r) for r in range(4)] == [2, 3, 0, 1]
    layout.check_replicas()
    Layout(rank=0, nodes=((0,), (1,), (2,))).check_replicas()


@pytest.mark.parametrize("nodes", [((0, 1, 2, 3),), ((0, 2), (1, 3)), ((0, 1, 2), (3,))])
def test_replicas_need_partners_on_other_nodes(nodes):
    with pytest.raises(ValueError, match="replicas=2"):
        Layout(rank=0, nodes=nodes).check_replicas()


def _held(files: dict[str, int], *, whole: bool = False) -> tuple[list[str], dict[str, int], bool]:
    required = sorted(["__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json"])
    return required, files, whole


def test_a_step_is_listed_when_every_file_is_on_some_node_or_durable():
    meta = {".metadata": 10, "manifest.json": 5}
    node0 = {3: _held({**meta, "__0_0.distcp": 100, "__1_0.distcp": 100}),   # own files + rank 1's replica
             2: _held({**meta, "__0_0.distcp": 100})}
    node1: dict[int, tuple[list[str], dict[str, int], bool]] = {}            # node 1 lost its directory
    survey = Survey(holdings=[node0, node1], durable=[1])
    assert survey.steps() == [1, 3]
    assert survey.on_nodes(2)[1] == ["__1_0.distcp"]
    assert "step 2: ['__1_0.distcp']" in survey.explain(2) and "replicas=2" in survey.explain(None)
    assert survey.explain(3) == ""
    assert Survey(holdings=[node0, None], durable=[2]).steps() == [2, 3]
