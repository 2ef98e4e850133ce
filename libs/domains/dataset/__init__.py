"""The `dataset` domain: the rows of a user's JSONL or parquet file as single-turn tasks."""

from pathlib import Path

from libs.domains.dataset.env import ENV_NAME, DatasetEnv
from libs.domains.dataset.rubric import dataset_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(ENV_NAME, Path(__file__).resolve().parent, DatasetEnv, dataset_rubric)
