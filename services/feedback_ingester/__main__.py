"""Run the feedback-ingester service.

    rlpipe run feedback-ingester        (or: python -m services.feedback_ingester)

Configured by RLPIPE_FEEDBACK_INGESTER_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.feedback_ingester.service import FeedbackIngesterService
from services.feedback_ingester.settings import FeedbackIngesterSettings


def main() -> None:
    settings = settings_or_exit(FeedbackIngesterSettings)
    run_service(FeedbackIngesterService(settings), settings)


if __name__ == "__main__":
    main()
