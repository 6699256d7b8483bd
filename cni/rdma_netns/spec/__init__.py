"""The CNI protocol itself: errors, versions, environment, results. No kernel access here, and
no import of any other part of this package: every layer may import it.
"""
