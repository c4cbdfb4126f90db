"""What Kiln reports about a model: an artifact's report.md, the economics (`optimize report`), the serving model,
and what `optimize inspect` and `optimize gate` print.

    from kiln.optimizer.report.economics import economics_report, load_scenario
    from kiln.optimizer.report.artifact_report import render_report
"""
