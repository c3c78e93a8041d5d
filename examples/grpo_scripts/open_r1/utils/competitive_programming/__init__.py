from .cf_scoring import score_submission
from .code_patcher import patch_code
from .ioi_scoring import SubtaskResult, score_subtask, score_subtasks
from .ioi_utils import add_includes
from .morph_client import get_morph_client_from_env
from .piston_client import get_piston_client_from_env, get_slurm_piston_endpoints


__all__ = [
    "get_piston_client_from_env",
    "get_slurm_piston_endpoints",
    "get_morph_client_from_env",
    "patch_code",
    "score_submission",
    "score_subtask",
    "score_subtasks",
    "add_includes",
    "SubtaskResult",
]
