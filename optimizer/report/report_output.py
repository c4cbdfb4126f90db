"""`optimize report -o DIR`: report.md, the waterfall PNG and kiln_report.json, written atomically into a
directory of their own (optimizer.output_dir's policy).

    check_report_output(out, target)            # before the report is computed
    write_report(report, out, target)           # [out/report.md, out/economics_waterfall.png]
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.kernels.errors import KilnError, clip
from kiln.optimizer import __version__
from kiln.optimizer.output_dir import EXPORT_MARKER, REPORT_MARKER, atomic_directory, check_output
from kiln.optimizer.report.economics_text import economics_markdown
from kiln.optimizer.report.waterfall_plot import WATERFALL_PNG, waterfall_png
from kiln.runtime.artifact import MANIFEST


def check_report_output(directory: Path | str, target: Path | str | None = None) -> Path:
    """`report -o DIR`, checked before the report is computed (optimizer.output_dir's policy): never an artifact or
    an export (their checksums and tables), never the input or inside it, and a directory that exists must be
    empty or Kiln's own earlier report (its kiln_report.json lists every file), which a report replaces without
    --overwrite: it is regenerated from its inputs. Anything else there (the user's own report.md) is refused."""
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        raise KilnError(f"{clip(directory)} is a Kiln artifact; writing there would break its checksums (the build "
                        "writes the economics into the artifact's report.md)")
    if (directory / EXPORT_MARKER).exists():
        raise KilnError(f"{clip(directory)} is a Kiln export; write the report to a directory of its own")
    if directory.exists() and not directory.is_dir():
        raise KilnError(f"{clip(directory)} exists and is not a directory")
    inputs = []
    if target is not None:
        target = Path(target)
        # a config directory's input is its config.json: a report beside it (DIR/out) is fine
        inputs.append(target / "config.json" if target.is_dir() and not (target / MANIFEST).exists() else target)
    return check_output(directory, True, inputs)


def write_report(report: dict, directory: Path, target: Path | str | None = None) -> list[Path]:
    """`-o DIR`: report.md (the economics section), the waterfall PNG and kiln_report.json (what Kiln wrote), into
    DIR atomically; never into an artifact, an export or a directory holding anything else
    (check_report_output)."""
    out = check_report_output(directory, target)
    markdown, png = "\n".join(economics_markdown(report)) + "\n", waterfall_png(report)
    check_report_output(directory, target)  # again: rendering took a while
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "report.md").write_text(markdown)
        (tmp / WATERFALL_PNG).write_bytes(png)
        (tmp / REPORT_MARKER).write_text(json.dumps({"kiln_version": __version__, "source": str(target)}) + "\n")
    return [Path(directory) / "report.md", Path(directory) / WATERFALL_PNG]
