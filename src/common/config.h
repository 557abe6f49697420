// Schema-driven configuration: a flat map "section.key" -> typed value.
//
// A Schema lists every accepted key with its type, default, allowed range or
// choices and a one-line doc. A Config starts at the defaults and takes values
// from TOML files and "section.key=value" overrides; every value is checked
// against the schema when it is set, so a Config is always valid. Unknown keys
// and out-of-range values throw InvalidInput naming the key, the offending
// value, where it came from and what is allowed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace limbo {

using ConfigValue = std::variant<bool, int64_t, double, std::string>;

enum class ValueType { Bool, Int, Float, String };

struct KeySpec {
  std::string key;  // "section.name"
  ValueType type = ValueType::String;
  ConfigValue def;
  std::optional<double> min;  // inclusive unless min_open
  std::optional<double> max;  // inclusive unless max_open
  bool min_open = false;
  bool max_open = false;
  std::vector<std::string> choices;  // for strings; empty = free text
  std::string doc;
};

class Schema {
 public:
  // Adds a key; throws std::logic_error on duplicates or a bad default.
  Schema& add(KeySpec spec);
  const KeySpec* find(const std::string& key) const;
  const std::vector<KeySpec>& keys() const { return specs_; }
  // Markdown table of every key (the documented config schema).
  std::string to_markdown() const;

 private:
  std::vector<KeySpec> specs_;
  std::map<std::string, size_t> index_;
};

class Config {
 public:
  explicit Config(std::shared_ptr<const Schema> schema);

  // Loads a TOML file; tables map to sections. Throws InvalidInput.
  void load_toml_file(const std::string& path);
  void load_toml_string(const std::string& text, const std::string& origin);
  // Parses "section.key=value" (the value is parsed by the key's type).
  void apply_override(const std::string& assignment);
  // Sets one key from text, parsed by the key's type.
  void set_text(const std::string& key, const std::string& text,
                const std::string& origin);
  void set(const std::string& key, ConfigValue value,
           const std::string& origin);

  bool get_bool(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  // True when the value was given explicitly (not the default).
  bool is_set(const std::string& key) const;

  // The resolved configuration (every key) as TOML.
  std::string to_toml() const;
  const Schema& schema() const { return *schema_; }

 private:
  const KeySpec& spec_or_throw(const std::string& key,
                               const std::string& origin) const;
  const ConfigValue& value(const std::string& key, ValueType want) const;

  std::shared_ptr<const Schema> schema_;
  std::map<std::string, ConfigValue> values_;
  std::map<std::string, std::string> origins_;
};

std::string to_string(const ConfigValue& v);
const char* type_name(ValueType t);

}  // namespace limbo
