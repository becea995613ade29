// The IR's text form. One graph reads:
//
//   graph(%x: f32[s0, 8]{8, 1}@cpu, %s0: int):
//     %y: f32[s0, 8]{8, 1}@cpu = aten::add.Tensor(%x, 1.0)
//     %m: f32[s0]{1}@cpu, %i: i64[s0]{1}@cpu = aten::max.dim(%y, 1)
//     aten::_foreach_zero_([%x])
//     %z: f32[s0, 8]{8, 1}@cpu = aten::exp(%y) #0          (member of fusion group 0)
//     return (%y, %s0, None)
//
// Guarantees: print() is canonical and parse(print(g)) prints identically; literals keep their kind
// (1 is an int, 1.0 a float, f32 a dtype, cpu a device); floats print in their shortest round-trip form.
#include "ember/error.h"
#include "ember/ir.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <unordered_map>

namespace ember {
namespace {

struct EnumName {
  const char* name;
  int64_t value;
};

constexpr EnumName kDtypes[] = {
    {"u8", (int64_t)c10::ScalarType::Byte},        {"i8", (int64_t)c10::ScalarType::Char},
    {"i16", (int64_t)c10::ScalarType::Short},      {"i32", (int64_t)c10::ScalarType::Int},
    {"i64", (int64_t)c10::ScalarType::Long},       {"f16", (int64_t)c10::ScalarType::Half},
    {"f32", (int64_t)c10::ScalarType::Float},      {"f64", (int64_t)c10::ScalarType::Double},
    {"c32", (int64_t)c10::ScalarType::ComplexHalf}, {"c64", (int64_t)c10::ScalarType::ComplexFloat},
    {"c128", (int64_t)c10::ScalarType::ComplexDouble}, {"b8", (int64_t)c10::ScalarType::Bool},
    {"bf16", (int64_t)c10::ScalarType::BFloat16},  {"u16", (int64_t)c10::ScalarType::UInt16},
    {"u32", (int64_t)c10::ScalarType::UInt32},     {"u64", (int64_t)c10::ScalarType::UInt64},
    {"f8e4m3fn", (int64_t)c10::ScalarType::Float8_e4m3fn}, {"f8e5m2", (int64_t)c10::ScalarType::Float8_e5m2},
};
constexpr EnumName kLayouts[] = {
    {"strided", (int64_t)c10::Layout::Strided},       {"sparse_coo", (int64_t)c10::Layout::Sparse},
    {"sparse_csr", (int64_t)c10::Layout::SparseCsr},  {"sparse_csc", (int64_t)c10::Layout::SparseCsc},
    {"sparse_bsr", (int64_t)c10::Layout::SparseBsr},  {"sparse_bsc", (int64_t)c10::Layout::SparseBsc},
    {"_mkldnn", (int64_t)c10::Layout::Mkldnn},        {"jagged", (int64_t)c10::Layout::Jagged},
};
constexpr EnumName kMemoryFormats[] = {
    {"contiguous_format", (int64_t)c10::MemoryFormat::Contiguous},
    {"preserve_format", (int64_t)c10::MemoryFormat::Preserve},
    {"channels_last", (int64_t)c10::MemoryFormat::ChannelsLast},
    {"channels_last_3d", (int64_t)c10::MemoryFormat::ChannelsLast3d},
};

template <size_t N>
const char* name_of(const EnumName (&table)[N], int64_t v, const char* what) {
  for (const auto& e : table)
    if (e.value == v) return e.name;
  throw Error(std::string("IR print: no text name for ") + what + " " + std::to_string(v));
}

template <size_t N>
const EnumName* find_name(const EnumName (&table)[N], const std::string& s) {
  for (const auto& e : table)
    if (s == e.name) return &e;
  return nullptr;
}

// ---------------------------------------------------------------- printer

void print_float(std::string& out, double f) {
  if (std::isnan(f)) { out += "nan"; return; }
  if (std::isinf(f)) { out += f < 0 ? "-inf" : "inf"; return; }
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  out += s;
}

void print_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') { out += "\\n"; continue; }
    out += c;
  }
  out += '"';
}

void print_dims(std::string& out, const std::vector<Dim>& dims, char open, char close) {
  out += open;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += dims[i].is_constant() ? std::to_string(dims[i].value) : dims[i].expr;
  }
  out += close;
}

void print_type(std::string& out, const Type& t) {
  switch (t.kind) {
    case Type::Kind::Tensor:
      out += dtype_name(t.tensor.dtype);
      print_dims(out, t.tensor.sizes, '[', ']');
      print_dims(out, t.tensor.strides, '{', '}');
      out += '@';
      out += t.tensor.device.str();
      return;
    case Type::Kind::Int: out += "int"; return;
    case Type::Kind::Float: out += "float"; return;
    case Type::Kind::Bool: out += "bool"; return;
    case Type::Kind::None: out += "none"; return;
    case Type::Kind::Object: out += "object"; return;
  }
}

void print_arg(std::string& out, const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::Value: out += '%'; out += a.value->name; return;
    case Arg::Kind::None: out += "None"; return;
    case Arg::Kind::Bool: out += a.b ? "true" : "false"; return;
    case Arg::Kind::Int: out += std::to_string(a.i); return;
    case Arg::Kind::Float: print_float(out, a.f); return;
    case Arg::Kind::String: print_string(out, a.s); return;
    case Arg::Kind::Dtype: out += dtype_name(static_cast<c10::ScalarType>(a.i)); return;
    case Arg::Kind::Device: out += a.device.str(); return;
    case Arg::Kind::Layout: out += name_of(kLayouts, a.i, "layout"); return;
    case Arg::Kind::MemoryFormat: out += name_of(kMemoryFormats, a.i, "memory format"); return;
    case Arg::Kind::List:
      out += '[';
      for (size_t i = 0; i < a.list.size(); ++i) {
        if (i) out += ", ";
        print_arg(out, a.list[i]);
      }
      out += ']';
      return;
  }
}

void print_value_decl(std::string& out, const Value* v) {
  out += '%';
  out += v->name;
  out += ": ";
  print_type(out, v->type);
}

// ---------------------------------------------------------------- parser

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Graph parse_graph() {
    expect_word("graph");
    expect('(');
    if (!try_consume(')')) {
      do {
        std::string name = parse_value_name();
        expect(':');
        skip_spaces();
        Type t = parse_type();
        define(name, g_.add_input(name, t));
      } while (try_consume(','));
      expect(')');
    }
    expect(':');
    end_line();
    while (true) {
      skip_blank_lines();
      if (at_end()) fail("missing 'return'");
      if (peek_word("return")) break;
      parse_node();
    }
    expect_word("return");
    expect('(');
    std::vector<Arg> outs;
    if (!try_consume(')')) {
      do outs.push_back(parse_arg()); while (try_consume(','));
      expect(')');
    }
    g_.set_outputs(std::move(outs));
    skip_blank_lines();
    if (!at_end()) fail("text after 'return'");
    g_.verify();
    return std::move(g_);
  }

 private:
  void parse_node() {
    skip_spaces();
    std::vector<std::pair<std::string, Type>> outs;
    if (peek() == '%') {
      do {
        skip_spaces();
        std::string name = parse_value_name();
        expect(':');
        skip_spaces();
        outs.emplace_back(name, parse_type());
      } while (try_consume(','));
      expect('=');
    }
    skip_spaces();
    std::string op = parse_op_name();
    expect('(');
    std::vector<Arg> args;
    std::vector<std::pair<std::string, Arg>> kwargs;
    if (!try_consume(')')) {
      do {
        skip_spaces();
        size_t save = pos_;
        std::string word = is_ident_start(peek()) ? parse_ident() : std::string();
        if (!word.empty() && peek() == '=') {
          ++pos_;
          kwargs.emplace_back(word, parse_arg());
        } else {
          pos_ = save;
          if (!kwargs.empty()) fail("positional argument after keyword argument");
          args.push_back(parse_arg());
        }
      } while (try_consume(','));
      expect(')');
    }
    int group = -1;
    if (try_consume('#')) {
      Arg id = parse_number();
      if (id.kind != Arg::Kind::Int || id.i < 0) fail("fusion group must be a non-negative integer");
      group = static_cast<int>(id.i);
    }
    end_line();
    Node* n = g_.add_node(op, std::move(args), std::move(kwargs), std::move(outs));
    n->group = group;
    for (Value* v : n->outputs) define(v->name, v);
  }

  Type parse_type() {
    std::string word = parse_ident();
    if (word == "int") return Type::of(Type::Kind::Int);
    if (word == "float") return Type::of(Type::Kind::Float);
    if (word == "bool") return Type::of(Type::Kind::Bool);
    if (word == "none") return Type::of(Type::Kind::None);
    if (word == "object") return Type::of(Type::Kind::Object);
    TensorType t;
    t.dtype = parse_dtype(word);
    t.sizes = parse_dims('[', ']');
    t.strides = parse_dims('{', '}');
    // Every pass and kernel indexes strides by the sizes' dimensions: a type with fewer would read past them.
    if (t.strides.size() != t.sizes.size())
      fail("a tensor type with " + std::to_string(t.sizes.size()) + " sizes and " + std::to_string(t.strides.size()) +
           " strides");
    expect('@');
    t.device = parse_device(parse_ident());
    return Type::of_tensor(std::move(t));
  }

  std::vector<Dim> parse_dims(char open, char close) {
    expect(open);
    std::vector<Dim> dims;
    skip_spaces();
    if (try_consume(close)) return dims;
    do {
      skip_spaces();
      size_t start = pos_;
      int depth = 0;
      while (!at_end()) {
        char c = s_[pos_];
        if (c == '(') ++depth;
        else if (c == ')') --depth;
        else if (depth == 0 && (c == ',' || c == close)) break;
        else if (c == '\n' || c == ' ') break;
        ++pos_;
      }
      std::string text = s_.substr(start, pos_ - start);
      if (text.empty()) fail("empty dimension");
      int64_t v = 0;
      auto res = std::from_chars(text.data(), text.data() + text.size(), v);
      if (res.ec == std::errc() && res.ptr == text.data() + text.size())
        dims.push_back(Dim::constant(v));
      else
        dims.push_back(Dim::symbolic(text));
    } while (try_consume(','));
    expect(close);
    return dims;
  }

  Arg parse_arg() {
    skip_spaces();
    char c = peek();
    if (c == '%') {
      std::string name = parse_value_name();
      auto it = values_.find(name);
      if (it == values_.end()) fail("unknown value %" + name);
      return Arg::of(it->second);
    }
    if (c == '[') {
      ++pos_;
      std::vector<Arg> items;
      skip_spaces();
      if (!try_consume(']')) {
        do items.push_back(parse_arg()); while (try_consume(','));
        expect(']');
      }
      return Arg::of_list(std::move(items));
    }
    if (c == '"') return Arg::of_string(parse_quoted());
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    std::string word = parse_ident();
    if (word == "None") return Arg::none();
    if (word == "true") return Arg::of_bool(true);
    if (word == "false") return Arg::of_bool(false);
    if (word == "inf") return Arg::of_float(INFINITY);
    if (word == "nan") return Arg::of_float(NAN);
    if (const EnumName* e = find_name(kDtypes, word)) return Arg::of_dtype(static_cast<c10::ScalarType>(e->value));
    if (const EnumName* e = find_name(kLayouts, word)) return Arg::of_layout(static_cast<c10::Layout>(e->value));
    if (const EnumName* e = find_name(kMemoryFormats, word))
      return Arg::of_memory_format(static_cast<c10::MemoryFormat>(e->value));
    return Arg::of_device(parse_device(word));
  }

  Arg parse_number() {
    size_t start = pos_;
    if (peek() == '-') ++pos_;
    if (s_.compare(pos_, 3, "inf") == 0) { pos_ += 3; return Arg::of_float(-INFINITY); }
    bool is_float = false;
    while (!at_end()) {
      char c = s_[pos_];
      if (c == '.' || c == 'e' || c == 'E') is_float = true;
      else if (!((c >= '0' && c <= '9') || ((c == '-' || c == '+') && (s_[pos_ - 1] == 'e' || s_[pos_ - 1] == 'E'))))
        break;
      ++pos_;
    }
    const char* b = s_.data() + start;
    const char* e = s_.data() + pos_;
    if (is_float) {
      double f = 0;
      auto res = std::from_chars(b, e, f);
      if (res.ec != std::errc() || res.ptr != e) fail("bad float literal");
      return Arg::of_float(f);
    }
    int64_t i = 0;
    auto res = std::from_chars(b, e, i);
    if (res.ec != std::errc() || res.ptr != e) fail("bad int literal");
    return Arg::of_int(i);
  }

  std::string parse_quoted() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (c == '\\') {
        if (at_end()) fail("unterminated string");
        char n = s_[pos_++];
        out += n == 'n' ? '\n' : n;
      } else {
        out += c;
      }
    }
  }

  c10::ScalarType parse_dtype(const std::string& word) {
    if (const EnumName* e = find_name(kDtypes, word)) return static_cast<c10::ScalarType>(e->value);
    fail("unknown dtype '" + word + "'");
  }

  c10::Device parse_device(const std::string& word) {
    try {
      return c10::Device(word);
    } catch (const std::exception&) {
      fail("unknown literal '" + word + "'");
    }
  }

  std::string parse_value_name() {
    expect('%');
    size_t start = pos_;
    while (!at_end() && (is_ident_char(s_[pos_]) || s_[pos_] == '.')) ++pos_;
    if (pos_ == start) fail("empty value name");
    return s_.substr(start, pos_ - start);
  }

  std::string parse_op_name() {
    size_t start = pos_;
    while (!at_end() && (is_ident_char(s_[pos_]) || s_[pos_] == ':' || s_[pos_] == '.')) ++pos_;
    if (pos_ == start) fail("expected an op name");
    return s_.substr(start, pos_ - start);
  }

  // Identifiers include ':' so that devices such as cuda:0 read as one word.
  std::string parse_ident() {
    skip_spaces();
    size_t start = pos_;
    while (!at_end() && (is_ident_char(s_[pos_]) || s_[pos_] == ':')) ++pos_;
    if (pos_ == start) fail(std::string("unexpected character '") + (at_end() ? ' ' : s_[pos_]) + "'");
    return s_.substr(start, pos_ - start);
  }

  void define(const std::string& name, Value* v) {
    if (!values_.emplace(name, v).second) fail("value %" + name + " defined twice");
  }

  static bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
  static bool is_ident_char(char c) { return is_ident_start(c) || (c >= '0' && c <= '9'); }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_spaces() {
    while (!at_end() && s_[pos_] == ' ') ++pos_;
  }
  void skip_blank_lines() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\n')) ++pos_;
  }
  bool try_consume(char c) {
    skip_spaces();
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!try_consume(c)) fail(std::string("expected '") + c + "'");
  }
  bool peek_word(const char* w) {
    skip_spaces();
    return s_.compare(pos_, std::strlen(w), w) == 0;
  }
  void expect_word(const char* w) {
    if (!peek_word(w)) fail(std::string("expected '") + w + "'");
    pos_ += std::strlen(w);
  }
  void end_line() {
    skip_spaces();
    if (!at_end() && s_[pos_] != '\n') fail("expected end of line");
    if (!at_end()) ++pos_;
  }
  [[noreturn]] void fail(const std::string& msg) const {
    size_t line = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) line += s_[i] == '\n';
    throw Error("IR parse error at line " + std::to_string(line) + ": " + msg);
  }

  const std::string& s_;
  size_t pos_ = 0;
  Graph g_;
  std::unordered_map<std::string, Value*> values_;
};

}  // namespace

const char* dtype_name(c10::ScalarType t) { return name_of(kDtypes, static_cast<int64_t>(t), "dtype"); }

std::string print(const Graph& g) {
  std::string out = "graph(";
  for (size_t i = 0; i < g.inputs().size(); ++i) {
    if (i) out += ", ";
    print_value_decl(out, g.inputs()[i]);
  }
  out += "):\n";
  for (const auto& n : g.nodes()) {
    out += "  ";
    for (size_t i = 0; i < n->outputs.size(); ++i) {
      if (i) out += ", ";
      print_value_decl(out, n->outputs[i]);
    }
    if (!n->outputs.empty()) out += " = ";
    out += print_call(*n);
    if (n->group >= 0) out += " #" + std::to_string(n->group);
    out += '\n';
  }
  out += "  return (";
  for (size_t i = 0; i < g.outputs().size(); ++i) {
    if (i) out += ", ";
    print_arg(out, g.outputs()[i]);
  }
  out += ")\n";
  return out;
}

Graph parse(const std::string& text) { return Parser(text).parse_graph(); }

std::string print_call(const Node& n) {
  std::string out = n.op;
  out += '(';
  bool first = true;
  for (const Arg& a : n.args) {
    if (!first) out += ", ";
    first = false;
    print_arg(out, a);
  }
  for (const auto& [name, a] : n.kwargs) {
    if (!first) out += ", ";
    first = false;
    out += name;
    out += '=';
    print_arg(out, a);
  }
  out += ')';
  return out;
}

}  // namespace ember
