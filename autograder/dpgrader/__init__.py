"""Hidden checks: imported only by hidden test cells, never released to learners."""
