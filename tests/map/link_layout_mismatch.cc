// Never built by default: map.a_unit_built_with_the_other_link_layout_fails_to_link builds
// it, with GRACE_MAP_LINK_TAGS=0, against the grace::map library built with link tags, and
// expects the link to fail naming the layout this unit needs (split_list.h, the ABI tag).
#include "grace/map/hash_map.h"

int main() {
  grace::hash_map<int, int> map;
  return map.insert(1, 1) ? 0 : 1;
}
