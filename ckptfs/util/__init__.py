"""Leaf helpers with no ckptfs knowledge: background threads, single-flight calls, figures
(histograms, rates), byte budgets, and files created safely (owned 0700 directories, O_NOFOLLOW, O_EXCL)."""
