"""What runs inside a graded rank, on the learner's side of the grader's sandbox.

The grader (autograder/dpgrader/judge/) runs learner code in sandboxed rank processes: `zygote`
(a warm interpreter that forks one rank per launch), `routed` (the process group whose every
message goes through the grader's router) and `wire` (the frames both sides speak, never pickle).
They live in the released course only because the sandboxes see nothing else; notebooks never
import them.
"""
