"""lm-eval through Kiln's runtime: task YAMLs for `optimize gate --tasks`, and lm-eval's model `kiln`.

    tasks           EngineLM (lm-eval's TemplateLM over an engine), run_tasks and each task's floor
    lm_eval_model   KilnLM (`lm_eval --model kiln --model_args artifact=DIR`) and `kiln-lm-eval`
    lm_eval_plugin  the .pth hook (setup.py embeds its source) that makes lm-eval know the name `kiln`
"""
