// Every graph-to-graph pass, one per file in this folder.
#pragma once

#include "ember/compiler.h"

#include <unordered_set>

namespace ember {

void canonicalize(Graph& graph, PassContext& ctx);
void fold_batched_matmul(Graph& graph, PassContext& ctx);
void fold_batchnorm(Graph& graph, PassContext& ctx);
void batchnorm_pointwise(Graph& graph, PassContext& ctx);
void rotate_half(Graph& graph, PassContext& ctx);
void eliminate_dead_code(Graph& graph, PassContext& ctx);
// The nodes eliminate_dead_code removes: nothing reaches a graph output or an effect from them.
std::unordered_set<const Node*> dead_nodes(const Graph& graph);
void eliminate_common_subexpressions(Graph& graph, PassContext& ctx);
void claim_matmul_epilogues(Graph& graph, PassContext& ctx);
void fuse_addmm_activation(Graph& graph, PassContext& ctx);
void fuse_linear_chains(Graph& graph, PassContext& ctx);
void pad_matmul(Graph& graph, PassContext& ctx);
void fuse(Graph& graph, PassContext& ctx);
void overlap_collectives(Graph& graph, PassContext& ctx);

}  // namespace ember
