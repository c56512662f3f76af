"""The ``torch.backends`` entry point of pyproject.toml as a metadata-only distribution, for
tests that need it in processes they start (an editable install made before the entry
point was declared lacks it; a newer one declares it twice, which registration tolerates)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def declared() -> dict:
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["entry-points"]["torch.backends"]


def autoload_pythonpath(directory) -> str:
    """Write the distribution under ``directory``; return a ``PYTHONPATH`` that has it (and
    this checkout) first."""
    info = os.path.join(str(directory), "commlib_autoload_test-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: commlib-autoload-test\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[torch.backends]\n" + "".join(f"{k} = {v}\n" for k, v in declared().items()))
    return os.pathsep.join([str(directory), ROOT, os.environ.get("PYTHONPATH", "")])
