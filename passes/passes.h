// Every graph-to-graph pass, one per file in this folder.
#pragma once

#include "ember/compiler.h"

namespace ember {

void canonicalize(Graph& graph, PassContext& ctx);
void fold_batched_matmul(Graph& graph, PassContext& ctx);
void fold_batchnorm(Graph& graph, PassContext& ctx);
void eliminate_dead_code(Graph& graph, PassContext& ctx);
void eliminate_common_subexpressions(Graph& graph, PassContext& ctx);
void claim_matmul_epilogues(Graph& graph, PassContext& ctx);
void fuse_addmm_activation(Graph& graph, PassContext& ctx);
void fuse(Graph& graph, PassContext& ctx);

}  // namespace ember
