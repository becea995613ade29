// Every graph-to-graph pass, one per file in this folder.
#pragma once

#include "ember/compiler.h"

namespace ember {

void eliminate_dead_code(Graph& graph, PassContext& ctx);
void eliminate_common_subexpressions(Graph& graph, PassContext& ctx);
void fuse(Graph& graph, PassContext& ctx);

}  // namespace ember
