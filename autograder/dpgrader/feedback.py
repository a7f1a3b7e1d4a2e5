"""Feedback without the hidden tests.

nbgrader's ClearHiddenTests removes the hidden lines from a test cell's source,
but IPython's traceback of a failed cell quotes the lines around the failure,
hidden ones included. This preprocessor keeps only the error's name and message
(the short, deliberate text the checks raise) in the feedback of graded cells.
"""

from nbgrader.preprocessors import NbGraderPreprocessor


class ScrubTracebacks(NbGraderPreprocessor):
    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade"):
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources
