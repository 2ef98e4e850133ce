"""Run the feedback-ingester service.

    rlpipe run feedback-ingester        (or: python -m services.feedback_ingester)

Configured by RLPIPE_FEEDBACK_INGESTER_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.feedback_ingester.settings import FeedbackIngesterSettings

IDLE_REASON = "idle: the HTTP feedback API and the join arrive with issue #6"


def main() -> None:
    run_service(IdleService("feedback-ingester", IDLE_REASON), FeedbackIngesterSettings())


if __name__ == "__main__":
    main()
