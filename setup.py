"""Everything about the package is in pyproject.toml; this file only adds `kiln-lm-eval.pth` to what gets
installed, in wheels and in editable installs alike: one line that makes lm-eval's command line know the model
`kiln` (optimizer/eval/lm_eval_plugin.py says how and why; reinstall after changing it)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "kiln-lm-eval.pth"
HOOK_SOURCE = Path(__file__).parent / "optimizer" / "eval" / "lm_eval_plugin.py"


def pth_line() -> str:
    """The hook's whole source on one line: site.py runs a .pth line that starts with `import`. It runs in a
    namespace of its own and imports no kiln module, so a process that never uses lm-eval loads nothing of
    Kiln's (kiln.runtime's import isolation holds)."""
    source = HOOK_SOURCE.read_text()
    return f"import sys; exec(compile({source!r}, {PTH_NAME!r}, 'exec'), {{'__name__': 'kiln_lm_eval_hook'}})\n"


class BuildPyWithPth(build_py):
    """build_py, plus the .pth at the top of the built tree (a wheel's purelib root)."""

    def run(self):
        super().run()
        self._write(Path(self.build_lib))
        if getattr(self, "editable_mode", False):  # an editable wheel is assembled from install's tree instead
            self._write(Path(self.get_finalized_command("install").install_lib))

    def _write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PTH_NAME).write_text(pth_line())

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH_NAME))]


setup(cmdclass={"build_py": BuildPyWithPth})
