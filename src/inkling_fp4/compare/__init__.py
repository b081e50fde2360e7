"""Loss-gap analysis between runs and the comparison report."""
