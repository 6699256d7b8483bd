"""The CNI protocol itself: errors, versions, environment, results. No kernel access here."""
