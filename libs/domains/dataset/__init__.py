"""The `dataset` domain: the rows of a user's JSONL or parquet file as single-turn tasks."""

from pathlib import Path

from libs.domains.dataset.env import ENV_NAME, DatasetEnv
from libs.domains.dataset.rubric import dataset_rubric
from libs.domains.domain import Domain

DOMAIN = Domain(
    name=ENV_NAME,
    folder=Path(__file__).resolve().parent,
    env=DatasetEnv,
    rubric=dataset_rubric,
    description="rows of a JSONL/parquet file (env-gateway's dataset_path), checked by match",
)
