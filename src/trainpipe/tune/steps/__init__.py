"""Functions the pipeline DAG runs as steps by file path (pipeline/automl_step.py), each in its own process."""
