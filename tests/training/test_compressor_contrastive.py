"""The contrastive objective's positives (training/compressor_contrastive.py): questions that no summarised chunk
covers are counted, not left out of the batches without a word."""

from __future__ import annotations

import torch

from overstory.training.compressor_contrastive import QuestionPositives


def test_questions_no_chunk_covers_are_counted() -> None:
    # three questions; the first chunk covers question 0, the second questions 0 and 2, the third none
    positives = QuestionPositives(torch.zeros(3, 4), by_record=[[0], [0, 2], []])
    assert positives.covered_records == 2 and positives.uncovered_questions == 1  # question 1
    assert positives.coverage("train") == {"train_chunks_covering": 2, "train_questions": 3,
                                           "train_questions_uncovered": 1}
    assert QuestionPositives(torch.zeros(0, 4), by_record=[[], []]).uncovered_questions == 0
