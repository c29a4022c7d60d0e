"""3D parallelism without torch's global registry: the mesh layout of an epoch, its explicit process
groups, tensor-parallel layers, the pipeline schedule, and the logical (layout-free) view of the state.

- `layout.py`   - `Layout`: a rank's (pp, dp, tp) coordinate and the members of each of its groups;
- `groups.py`   - `MeshComm`: an epoch's process groups (world, dp, tp, pipeline edges, embedding, repl);
- `layers.py`   - column/row/vocabulary-parallel layers and the parallel cross-entropy (explicit `TPHandle`);
- `stage.py`    - the `Stage` seam (the part of a model one rank runs) and `WholeModel` (data-parallel only);
- `gpt.py`      - the reference GPT cut into (pp, tp) stages;
- `pipeline.py` - the 1F1B schedule over a step's microbatches;
- `logical.py`  - segments mapping a stage's flat state to the full model's, for hashing, export and resume.
"""

from phoenixft.parallel.layout import Layout

__all__ = ["Layout"]
