"""Files shipped with the classifier: the subtask corpus, its measurements and the default classifier.

A package (not a bare folder) so that wheels carry these files under the package-data patterns.
"""
