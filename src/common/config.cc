#include "common/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "common/error.h"

namespace limbo {
namespace {

std::string section_of(const std::string& key) {
  auto dot = key.find('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Edit distance, for "did you mean" suggestions.
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string allowed_text(const KeySpec& s) {
  std::ostringstream os;
  if (!s.choices.empty()) {
    os << "one of {";
    for (size_t i = 0; i < s.choices.size(); ++i)
      os << (i ? ", " : "") << s.choices[i];
    os << "}";
    return os.str();
  }
  os << type_name(s.type);
  if (s.min || s.max) {
    os << " in " << (s.min && !s.min_open ? "[" : "(");
    // Integer bounds print whole (16777216, not 1.67772e+07).
    auto bound = [&](double b) {
      if (s.type == ValueType::Int) os << static_cast<long long>(b);
      else os << b;
    };
    if (s.min) bound(*s.min); else os << "-inf";
    os << ", ";
    if (s.max) bound(*s.max); else os << "inf";
    os << (s.max && !s.max_open ? "]" : ")");
  }
  return os.str();
}

void check_value(const KeySpec& s, const ConfigValue& v,
                 const std::string& origin) {
  auto fail = [&](const std::string& why) {
    throw InvalidInput("config key '" + s.key + "' = " + to_string(v) +
                       " (from " + origin + ") " + why + "; allowed: " +
                       allowed_text(s));
  };
  switch (s.type) {
    case ValueType::Bool:
      if (!std::holds_alternative<bool>(v)) fail("is not a boolean");
      return;
    case ValueType::String:
      if (!std::holds_alternative<std::string>(v)) fail("is not a string");
      if (!s.choices.empty()) {
        const auto& str = std::get<std::string>(v);
        bool ok = false;
        for (const auto& c : s.choices) ok = ok || c == str;
        if (!ok) fail("is not an allowed choice");
      }
      return;
    case ValueType::Int:
    case ValueType::Float: {
      double x;
      if (s.type == ValueType::Int) {
        if (!std::holds_alternative<int64_t>(v)) fail("is not an integer");
        x = static_cast<double>(std::get<int64_t>(v));
      } else {
        if (!std::holds_alternative<double>(v)) fail("is not a number");
        x = std::get<double>(v);
        if (!std::isfinite(x) && !(std::isinf(x) && !s.max)) fail("is not finite");
      }
      if (s.min && (x < *s.min || (s.min_open && x == *s.min)))
        fail("is out of range");
      if (s.max && (x > *s.max || (s.max_open && x == *s.max)))
        fail("is out of range");
      return;
    }
  }
}

ConfigValue from_toml_node(const toml::node& node, const KeySpec& s,
                           const std::string& origin) {
  if (auto b = node.as_boolean()) return b->get();
  if (auto i = node.as_integer()) {
    if (s.type == ValueType::Float) return static_cast<double>(i->get());
    return i->get();
  }
  if (auto f = node.as_floating_point()) return f->get();
  if (auto str = node.as_string()) return str->get();
  if (auto arr = node.as_array()) {
    // Lists (e.g. milestones) are kept as comma-separated text.
    std::string joined;
    for (const auto& el : *arr) {
      if (!joined.empty()) joined += ",";
      if (auto ii = el.as_integer()) joined += std::to_string(ii->get());
      else if (auto ff = el.as_floating_point()) joined += std::to_string(ff->get());
      else if (auto ss = el.as_string()) joined += ss->get();
      else throw InvalidInput("config key '" + s.key + "' (from " + origin +
                              "): list elements must be numbers or strings");
    }
    return joined;
  }
  throw InvalidInput("config key '" + s.key + "' (from " + origin +
                     ") has an unsupported TOML type; allowed: " +
                     allowed_text(s));
}

}  // namespace

const char* type_name(ValueType t) {
  switch (t) {
    case ValueType::Bool: return "bool";
    case ValueType::Int: return "integer";
    case ValueType::Float: return "number";
    case ValueType::String: return "string";
  }
  return "?";
}

std::string to_string(const ConfigValue& v) {
  if (auto b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  if (auto i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto d = std::get_if<double>(&v)) {
    if (std::isinf(*d)) return *d > 0 ? "inf" : "-inf";
    std::ostringstream os;
    os.precision(17);
    os << *d;
    std::string s = os.str();
    if (s.find_first_of(".eE") == std::string::npos) s += ".0";
    return s;
  }
  std::string out = "\"";
  for (char c : std::get<std::string>(v)) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

Schema& Schema::add(KeySpec spec) {
  if (index_.count(spec.key))
    throw std::logic_error("duplicate config key " + spec.key);
  check_value(spec, spec.def, "schema default");
  index_[spec.key] = specs_.size();
  specs_.push_back(std::move(spec));
  return *this;
}

const KeySpec* Schema::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &specs_[it->second];
}

std::string Schema::to_markdown() const {
  std::ostringstream os;
  std::string section = "\x01";
  for (const auto& s : specs_) {
    if (section_of(s.key) != section) {
      section = section_of(s.key);
      os << "\n### [" << section << "]\n\n"
         << "| key | type / allowed | default | meaning |\n"
         << "| --- | --- | --- | --- |\n";
    }
    os << "| `" << s.key << "` | " << allowed_text(s) << " | `"
       << to_string(s.def) << "` | " << s.doc << " |\n";
  }
  return os.str();
}

Config::Config(std::shared_ptr<const Schema> schema) : schema_(std::move(schema)) {
  for (const auto& s : schema_->keys()) values_[s.key] = s.def;
}

const KeySpec& Config::spec_or_throw(const std::string& key,
                                     const std::string& origin) const {
  if (const KeySpec* s = schema_->find(key)) return *s;
  std::string best;
  size_t best_d = 4;
  for (const auto& s : schema_->keys()) {
    size_t d = distance(key, s.key);
    if (d < best_d) best_d = d, best = s.key;
  }
  std::string msg = "unknown config key '" + key + "' (from " + origin + ")";
  if (!best.empty()) msg += "; did you mean '" + best + "'?";
  std::string sec = section_of(key), known;
  for (const auto& s : schema_->keys())
    if (section_of(s.key) == sec) known += (known.empty() ? "" : ", ") + s.key;
  if (!known.empty()) msg += " Keys in [" + sec + "]: " + known;
  else {
    std::string sections;
    for (const auto& s : schema_->keys()) {
      auto se = section_of(s.key);
      if (sections.find("[" + se + "]") == std::string::npos)
        sections += (sections.empty() ? "" : " ") + ("[" + se + "]");
    }
    msg += " Known sections: " + sections;
  }
  throw InvalidInput(msg);
}

void Config::set(const std::string& key, ConfigValue value,
                 const std::string& origin) {
  const KeySpec& s = spec_or_throw(key, origin);
  if (s.type == ValueType::Float && std::holds_alternative<int64_t>(value))
    value = static_cast<double>(std::get<int64_t>(value));
  check_value(s, value, origin);
  values_[key] = std::move(value);
  origins_[key] = origin;
}

void Config::set_text(const std::string& key, const std::string& text_in,
                      const std::string& origin) {
  const KeySpec& s = spec_or_throw(key, origin);
  const std::string text = trim(text_in);
  // A TOML array or quoted string reads as it would in a file, so that a
  // list may be written `--set data.augment=["hflip", "random_crop:2"]`.
  if (!text.empty() && (text.front() == '[' || text.front() == '"' || text.front() == '\'')) {
    toml::table tbl;
    try {
      tbl = toml::parse("v = " + text, origin);
    } catch (const toml::parse_error& e) {
      throw InvalidInput("config key '" + key + "' = '" + text + "' (from " + origin +
                         ") is not a TOML value: " + std::string(e.description()) + "; allowed: " +
                         allowed_text(s));
    }
    if (const toml::node* v = tbl.get("v")) {
      if (v->is_array() && s.type != ValueType::String)
        throw InvalidInput("config key '" + key + "' = '" + text + "' (from " + origin +
                           ") is a list; allowed: " + allowed_text(s));
      if (auto arr = v->as_array())
        for (const auto& el : *arr)
          if (!el.is_integer() && !el.is_floating_point() && !el.is_string())
            throw InvalidInput("config key '" + key + "' = '" + text + "' (from " + origin +
                               "): list elements must be numbers or strings");
      return set(key, from_toml_node(*v, s, origin), origin);
    }
  }
  auto bad = [&](const char* what) {
    throw InvalidInput("config key '" + key + "' = '" + text + "' (from " +
                       origin + ") is not " + what + "; allowed: " +
                       allowed_text(s));
  };
  switch (s.type) {
    case ValueType::Bool:
      if (text == "true" || text == "1" || text == "yes") return set(key, true, origin);
      if (text == "false" || text == "0" || text == "no") return set(key, false, origin);
      return bad("a boolean (true/false)");
    case ValueType::Int: {
      size_t pos = 0;
      int64_t v = 0;
      try { v = std::stoll(text, &pos); } catch (...) { bad("an integer"); }
      if (pos != text.size()) bad("an integer");
      return set(key, v, origin);
    }
    case ValueType::Float: {
      if (text == "inf") return set(key, std::numeric_limits<double>::infinity(), origin);
      size_t pos = 0;
      double v = 0;
      try { v = std::stod(text, &pos); } catch (...) { bad("a number"); }
      if (pos != text.size()) bad("a number");
      return set(key, v, origin);
    }
    case ValueType::String: {
      std::string t = text;
      if (t.size() >= 2 && t.front() == '"' && t.back() == '"')
        t = t.substr(1, t.size() - 2);
      return set(key, t, origin);
    }
  }
}

void Config::apply_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw InvalidInput("--set expects section.key=value, got '" + assignment + "'");
  set_text(trim(assignment.substr(0, eq)), assignment.substr(eq + 1), "--set " + assignment);
}

void Config::load_toml_string(const std::string& text, const std::string& origin) {
  toml::table tbl;
  try {
    tbl = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << origin << ":" << e.source().begin.line << ":" << e.source().begin.column
       << ": TOML syntax error: " << e.description();
    throw InvalidInput(os.str());
  }
  for (const auto& [sec, node] : tbl) {
    const auto* inner = node.as_table();
    std::string sec_name(sec.str());
    if (!inner)
      throw InvalidInput(origin + ": top-level key '" + sec_name +
                         "' must be a [section] table (e.g. [train])");
    for (const auto& [k, v] : *inner) {
      std::string key = sec_name + "." + std::string(k.str());
      const KeySpec& s = spec_or_throw(key, origin);
      set(key, from_toml_node(v, s, origin), origin);
    }
  }
}

void Config::load_toml_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidInput("cannot open config file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  load_toml_string(ss.str(), path);
}

const ConfigValue& Config::value(const std::string& key, ValueType want) const {
  const KeySpec* s = schema_->find(key);
  if (!s) throw std::logic_error("config key not in schema: " + key);
  if (s->type != want)
    throw std::logic_error("config key " + key + " read as wrong type");
  return values_.at(key);
}

bool Config::get_bool(const std::string& key) const {
  return std::get<bool>(value(key, ValueType::Bool));
}
int64_t Config::get_int(const std::string& key) const {
  return std::get<int64_t>(value(key, ValueType::Int));
}
double Config::get_float(const std::string& key) const {
  return std::get<double>(value(key, ValueType::Float));
}
const std::string& Config::get_string(const std::string& key) const {
  return std::get<std::string>(value(key, ValueType::String));
}
bool Config::is_set(const std::string& key) const { return origins_.count(key) > 0; }

std::string Config::to_toml() const {
  // One table per section, in the order sections first appear in the
  // schema, whatever order their keys were declared in (TOML refuses a
  // table defined twice).
  std::vector<std::string> order;
  std::map<std::string, std::string> body;
  for (const auto& s : schema_->keys()) {
    const std::string section = section_of(s.key);
    if (!body.count(section)) order.push_back(section);
    const auto& v = values_.at(s.key);
    std::string text = to_string(v);
    if (auto d = std::get_if<double>(&v); d && std::isinf(*d))
      text = *d > 0 ? "inf" : "-inf";  // TOML spells infinity 'inf'
    body[section] += s.key.substr(section.size() + 1) + " = " + text + "\n";
  }
  std::ostringstream os;
  for (const auto& section : order) os << (os.tellp() > 0 ? "\n" : "") << "[" << section << "]\n" << body[section];
  return os.str();
}

}  // namespace limbo
