"""The stage shortcut of site.yml (`gate`): the controller half (filter_plugins/spark_stage.py) and the
host half (library/spark_stage.py, as ansible.module_utils.sparkllm.stage.gate)."""
